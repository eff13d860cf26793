"""Quantized matmul kernels vs the float32 oneDNN path, for the default model's shapes.

Times one projection y = x @ W.T at M = 1 (single-request decode) and M = 32 (a batch)
for: fp32 oneDNN-prepacked (kvserve's float path), PyTorch's int8 and int4 weight-only
kernels with float32 and with bfloat16 activations, and the fp8 dequantizing path. This is
the measurement behind QuantizedLinear's choice of bfloat16 activations.

    python benchmarks/bench_quant_kernels.py
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import machine  # noqa: E402
from kvserve.model.layers.linear import linear, onednn_pack  # noqa: E402
from kvserve.model.layers.quantization import quantize_weight  # noqa: E402
from kvserve.model.layers.quantized_linear import QuantizedLinear  # noqa: E402

SHAPES = {"qkv": (960, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def best_of(fn, reps: int = 20, rounds: int = 3) -> float:
    """Microseconds per call, the best of a few rounds (the machine is shared); calls slower
    than 20 ms are timed once."""
    t0 = time.perf_counter()
    fn()
    if time.perf_counter() - t0 > 0.02:
        reps, rounds = 1, 1
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best * 1e6


def row(n: int, k: int, m: int) -> list[float]:
    """Microseconds for each path on one [n, k] weight and an [m, k] input."""
    w = torch.randn(n, k) * 0.05
    packed = onednn_pack(w)
    q8, q4, f8 = (QuantizedLinear(quantize_weight(w, meth)) for meth in ("int8", "int4", "fp8"))
    x = torch.randn(m, k)
    int8_fp32 = q8.scales.float()
    int4_fp32 = q4.scales_zeros.float()
    return [
        best_of(lambda: linear(x, w, None, packed)),
        best_of(lambda: torch.ops.aten._weight_int8pack_mm(x, q8.qweight, int8_fp32)),
        best_of(lambda: q8(x)),
        best_of(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, q4.qweight, q4.group_size, int4_fp32)),
        best_of(lambda: q4(x)),
        best_of(lambda: f8(x)),
    ]


def main() -> int:
    torch.manual_seed(0)
    print(machine())
    print("| N x K | M | fp32 oneDNN | int8 fp32-act | int8 bf16-act | int4 fp32-act | int4 bf16-act | fp8 |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (n, k) in SHAPES.items():
        for m in (1, 32):
            cols = row(n, k, m)
            print(f"| {name} {n}x{k} | {m} | " + " | ".join(f"{c:.0f}" for c in cols) + " |")
    print("(microseconds per call, best of 3 rounds; QuantizedLinear runs the bf16-act columns)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
