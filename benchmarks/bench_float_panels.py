"""kvserve's float panel kernels against oneDNN's packed linear, per batch size (issue 16).

The default model's four projection shapes x 30 layers in --dtype (bf16 ~202 MiB, fp32 twice
that: far larger than
the caches, so every call reads its weights from memory, as a decode step does), each M-row
batch through both kernels, alternating (--rounds times; the median of --reps passes each).
Prints ms per pass, the weight bytes read per second beside the machine's read bandwidth
measured in the same run, GFLOP/s, and panels / oneDNN. Needs a CPU the panels run on
(AVX-512 without AMX, and avx512_bf16 for bf16: float_panels.panel_variant).

    python benchmarks/bench_float_panels.py [--dtype bfloat16|float32] [--rows 1,4,32,64,512] [--rounds 2]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_decode_roofline import read_bandwidth  # noqa: E402
from benchmarks.common import machine  # noqa: E402
from benchmarks.cpu_info import cpu_flags  # noqa: E402
from kvserve.model.layers.float_panels import pack_panels, panel_linear  # noqa: E402
from kvserve.model.layers.linear import linear, onednn_pack  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down
LAYERS = 30


def pass_s(layers, m: int, panels: bool, reps: int, dtype: torch.dtype) -> float:
    """Median seconds of one pass over every layer's projections with an m-row input."""
    xs = {k: torch.randn(m, k).to(dtype) for _, k in SHAPES}

    def once() -> None:
        for layer in layers:
            for w, p, o in layer:
                x = xs[w.shape[1]]
                panel_linear(x, p, None) if panels else linear(x, w, None, o)

    once()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.inference_mode()
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,4,32,64,512")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = ap.parse_args()
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    weights = [[torch.randn(n, k).to(dtype) for n, k in SHAPES] for _ in range(LAYERS)]
    if pack_panels(weights[0][0]) is None:
        print(f"the {args.dtype} panels do not run on this CPU (flags: {cpu_flags()})")
        return 1
    layers = [[(w, pack_panels(w), onednn_pack(w)) for w in ws] for ws in weights]
    nbytes = sum(w.numel() * w.element_size() for ws in weights for w in ws)
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{machine()}; CPU flags: {cpu_flags()}; {now}")
    bandwidth = read_bandwidth() / 1e9
    print(f"{args.dtype}; read bandwidth {bandwidth:.1f} GB/s; weights {nbytes / 2**20:.0f} MiB per pass")
    print("| M | round | panels ms (GB/s, GFLOP/s) | oneDNN packed ms (GB/s, GFLOP/s) | panels / oneDNN |")
    print("|---|---|---|---|---|")
    for m in (int(r) for r in args.rows.split(",")):
        for r in range(args.rounds):
            a, b = (pass_s(layers, m, panels, args.reps, dtype) for panels in (True, False))
            flops = 2 * m * nbytes / weights[0][0].element_size()  # 2 x M x weights
            cell = [f"{t * 1e3:.2f} ({nbytes / t / 1e9:.1f}, {flops / t / 1e9:.0f})" for t in (a, b)]
            print(f"| {m} | {r + 1} | {cell[0]} | {cell[1]} | {a / b:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
