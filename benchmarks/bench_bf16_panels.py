"""kvserve's bf16 panel kernel against oneDNN's packed bf16 linear, per batch size (issue 16).

The default model's four projection shapes x 30 layers in bfloat16 (~270 MiB: far larger than
the caches, so every call reads its weights from memory, as a decode step does), each M-row
batch through both kernels, alternating (--rounds times; the median of --reps passes each).
Prints ms per pass, the weight bytes read per second beside the machine's read bandwidth
measured in the same run, GFLOP/s, and panels / oneDNN. Needs a CPU the panels run on
(avx512_bf16, no AMX: bf16_panels.panels_wanted).

    python benchmarks/bench_bf16_panels.py [--rows 1,4,32,64,512] [--rounds 2]
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
from kvserve.model.layers.bf16_panels import bf16_panel_linear, pack_bf16  # noqa: E402
from kvserve.model.layers.linear import linear, onednn_pack  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down
LAYERS = 30


def pass_s(layers, m: int, panels: bool, reps: int) -> float:
    """Median seconds of one pass over every layer's projections with an m-row input."""
    xs = {k: torch.randn(m, k).bfloat16() for _, k in SHAPES}

    def once() -> None:
        for layer in layers:
            for w, p, o in layer:
                x = xs[w.shape[1]]
                bf16_panel_linear(x, p, None) if panels else linear(x, w, None, o)

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
    args = ap.parse_args()
    torch.manual_seed(0)
    weights = [[torch.randn(n, k).bfloat16() for n, k in SHAPES] for _ in range(LAYERS)]
    if pack_bf16(weights[0][0]) is None:
        print(f"the bf16 panels do not run on this CPU (flags: {cpu_flags()})")
        return 1
    layers = [[(w, pack_bf16(w), onednn_pack(w)) for w in ws] for ws in weights]
    nbytes = sum(w.numel() * 2 for ws in weights for w in ws)
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{machine()}; CPU flags: {cpu_flags()}; {now}")
    print(f"read bandwidth {read_bandwidth() / 1e9:.1f} GB/s; weights {nbytes / 2**20:.0f} MiB per pass")
    print("| M | round | panels ms (GB/s, GFLOP/s) | oneDNN packed ms (GB/s, GFLOP/s) | panels / oneDNN |")
    print("|---|---|---|---|---|")
    for m in (int(r) for r in args.rows.split(",")):
        for r in range(args.rounds):
            a, b = pass_s(layers, m, True, args.reps), pass_s(layers, m, False, args.reps)
            flops = m * nbytes  # 2 x M x weights, at 2 bytes a weight
            cell = [f"{t * 1e3:.2f} ({nbytes / t / 1e9:.1f}, {flops / t / 1e9:.0f})" for t in (a, b)]
            print(f"| {m} | {r + 1} | {cell[0]} | {cell[1]} | {a / b:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
