"""Round-to-nearest-even done by hand, so quantized KV is bit-exact with kv_quant.py everywhere.

torch rounds float32 -> bfloat16 and float32 -> float8_e4m3fn to nearest-even, and so do the
GPU's conversion instructions; Triton's interpreter does not (3.7.1 truncates to bfloat16, and
its fp8 conversion loses the carry when the mantissa rounds up: 124.2 becomes 64). The helpers
below round in float32 arithmetic first, so the final cast only ever sees a representable value
and every backend, the interpreter included, stores the codes and scales `quantize_kv` does (int8 codes too).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to_int(y):
    """float32 with |y| < 2**22 -> the nearest integer (ties to even, as torch.round), as float32."""
    return (y + 12582912.0) - 12582912.0  # 1.5 * 2**23: the float32 grid step there is 1


@triton.jit
def round_to_bf16(x):
    """float32 -> the nearest bfloat16 value (ties to even), still as float32; finite x only."""
    bits = x.to(tl.int32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits & -65536).to(tl.float32, bitcast=True)  # -65536 == 0xFFFF0000


@triton.jit
def round_to_e4m3(y):
    """float32 in [-448, 448] -> the nearest float8 e4m3 value (ties to even), as float32.

    e4m3 has 3 mantissa bits: the grid step at |y| is 2**(exponent - 3) for normals (|y| >= 2**-6)
    and 2**-9 below (subnormals)."""
    a = tl.abs(y)
    exponent = ((tl.maximum(a, 0.015625).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    inv_step = ((3 - exponent + 127) << 23).to(tl.float32, bitcast=True)  # exact, unlike a GPU's `/`
    r = round_to_int(a * inv_step) * step
    return tl.where(y < 0, -r, r)
