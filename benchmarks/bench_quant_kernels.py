"""Quantized matmul kernels vs the float32 oneDNN path, for the default model's shapes.

Times one projection y = x @ W.T at M = 1 (single-request decode) up to 128 rows (batched
decode, prefill chunks) for: fp32 oneDNN-prepacked (kvserve's float path); PyTorch's int8 and
int4 weight-only kernels (bf16 activations); the dynamic int8 linear (`quantized::linear_dynamic`,
fbgemm / oneDNN); bf16 oneDNN on dequantized weights, kept packed (2 bytes a weight) or
dequantized from int8 per call; and what QuantizedLinear dispatches to for int8 and int4
(layers/quant_batched.py). CPU microseconds per call with one torch thread, the best of
several calls (benchmarks/common.py `cpu_us`: wall time on a shared machine measures the
scheduler). This is the measurement behind QuantizedLinear's per-row-count choice.

    python benchmarks/bench_quant_kernels.py [--rows 1,4,8,16,32,64,128] [--shapes qkv,gate_up]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import cpu_us, machine  # noqa: E402
from benchmarks.cpu_info import cpu_flags  # noqa: E402
from kvserve.model.layers.linear import linear, onednn_pack  # noqa: E402
from kvserve.model.layers.quant_batched import dynamic_int8_mm, dynamic_int8_pack  # noqa: E402
from kvserve.model.layers.quantization import quantize_weight  # noqa: E402
from kvserve.model.layers.quantized_linear import QuantizedLinear  # noqa: E402

SHAPES = {"qkv": (960, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


COLUMNS = ("fp32 oneDNN", "int8 w-only", "int8 dynamic", "int4 w-only", "bf16 kept", "bf16 from int8",
           "QL int8", "QL int4")  # fmt: skip


def kernels(n: int, k: int) -> dict:
    """Callables x -> y for each column, on one random [n, k] weight."""
    w = torch.randn(n, k) * 0.05
    packed = onednn_pack(w)
    codes8 = quantize_weight(w, "int8")
    q8, q4 = QuantizedLinear(codes8), QuantizedLinear(quantize_weight(w, "int4"))
    wo8, wo4 = QuantizedLinear(codes8), QuantizedLinear(quantize_weight(w, "int4"))
    wo8.bf16_min_rows, wo4.dynamic = 1 << 30, None  # weight-only kernels at every row count
    dyn = dynamic_int8_pack(codes8.codes, codes8.scales)
    w16 = codes8.dequantize(torch.bfloat16)
    p16 = onednn_pack(w16)
    s8 = codes8.scales.float()
    return {
        "fp32 oneDNN": lambda x: linear(x, w, None, packed),
        "int8 w-only": wo8,
        "int8 dynamic": (lambda x: dynamic_int8_mm(x, dyn)) if dyn is not None else None,
        "int4 w-only": wo4,
        "bf16 kept": lambda x: linear(x.bfloat16(), w16, None, p16).float(),
        "bf16 from int8": lambda x: F.linear(x.bfloat16(), codes8.codes.to(torch.bfloat16)).float() * s8,
        "QL int8": q8,
        "QL int4": q4,
    }


def time_one(fn, x: torch.Tensor, reps: int) -> float:
    return float("nan") if fn is None else cpu_us(lambda: fn(x), reps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,4,8,16,32,64,128")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    print(f"{machine()}; CPU flags: {cpu_flags()}; load average {os.getloadavg()[0]:.2f}")
    print("| N x K | M | " + " | ".join(COLUMNS) + " | QL int8 / fp32 | QL int4 / fp32 |")
    print("|---|---|" + "---|" * (len(COLUMNS) + 2))
    with torch.inference_mode():
        for name in args.shapes.split(","):
            n, k = SHAPES[name]
            fns = kernels(n, k)
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k)
                us = {c: time_one(f, x, args.reps) for c, f in fns.items()}
                f32 = us["fp32 oneDNN"]
                cells = " | ".join(f"{us[c]:.0f}" for c in COLUMNS)
                ratios = f"{us['QL int8'] / f32:.2f} | {us['QL int4'] / f32:.2f}"
                print(f"| {name} {n}x{k} | {m} | {cells} | {ratios} |")
    print("(CPU microseconds per call, one thread, best of --reps; QL = QuantizedLinear's dispatch)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
