"""The native int4 kernel (csrc/quant_matmul_cpu.cpp) against aten's int4 kernel and fp32 oneDNN.

For the default model's projection shapes at M = 1 (single-stream decode), 8, 32 and 64 rows
(batched decode): microseconds per call of y = x @ W.T for fp32 oneDNN-prepacked (kvserve's
float path), `aten._weight_int4pack_mm_for_cpu` (bf16 activations, kvserve's int4 path before
the native kernel), and the native kernel (16-row panels x int8 activations) for the variant
this CPU runs; for int8 per-row weights, `aten._weight_int8pack_mm` (bf16 activations) against
the native int8 kernel. Two timings per cell: one
thread's CPU time (best of --reps, benchmarks/common.py `cpu_us`) and the wall time with the
engine's two threads (best of --reps). This is the measurement behind QuantizedLinear's native dispatch.

    python benchmarks/bench_quant_native.py [--rows 1,8,32,64] [--reps 20]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import cpu_us, machine, wall_us  # noqa: E402
from benchmarks.cpu_info import cpu_flags  # noqa: E402
from kvserve.model.layers import quant_kernels as qk  # noqa: E402
from kvserve.model.layers.linear import linear, onednn_pack  # noqa: E402
from kvserve.model.layers.quantization import quantize_weight  # noqa: E402

SHAPES = {
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}
COLUMNS = ("fp32 oneDNN", "aten int4", "native int4", "aten int8", "native int8")


def kernels(n: int, k: int, mod) -> dict:
    w = torch.randn(n, k) * 0.05
    packed = onednn_pack(w)
    qw = quantize_weight(w, "int4")
    a_codes = torch._convert_weight_to_int4pack_for_cpu(qw.codes.to(torch.int32), 1)
    a_sz = torch.stack([qw.scales.t(), qw.zeros.t()], -1).contiguous()
    codes, sz = qk.pack_int4(qw.codes, qw.scales, qw.zeros)
    q8 = quantize_weight(w, "int8")
    codes8, scales8 = qk.pack_int8(q8.codes, q8.scales)
    return {
        "aten int8": lambda x: torch.ops.aten._weight_int8pack_mm(x.bfloat16(), q8.codes, q8.scales).float(),
        "native int8": lambda x: mod.int8_mm(x, codes8, scales8, n),
        "fp32 oneDNN": lambda x: linear(x, w, None, packed),
        "aten int4": lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.bfloat16(), a_codes, 32, a_sz
        ).float(),
        "native int4": lambda x: mod.int4_mm(x, codes, sz, n),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,8,32,64")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    torch.manual_seed(0)
    mod = qk.load_quant_kernels()
    if mod is None:
        print("native kernel unavailable")
        return 1
    print(
        f"{machine()}; CPU flags: {cpu_flags()}; native variant {mod.isa()}; load average {os.getloadavg()}"
    )
    print("us per call: 1-thread CPU time / 2-thread wall time (best of reps)")
    print("| N x K | M | " + " | ".join(COLUMNS) + " |")
    print("|---|---|" + "---|" * len(COLUMNS))
    with torch.inference_mode():
        for name in args.shapes.split(","):
            n, k = SHAPES[name]
            fns = kernels(n, k, mod)
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k)
                cells = []
                for col in COLUMNS:
                    torch.set_num_threads(1)
                    one = cpu_us(lambda f=fns[col], x=x: f(x), args.reps)
                    torch.set_num_threads(2)
                    two = wall_us(lambda f=fns[col], x=x: f(x), args.reps)
                    cells.append(f"{one:.0f} / {two:.0f}")
                print(f"| {name} {n}x{k} | {m} | " + " | ".join(cells) + " |", flush=True)
    print(f"load average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
