"""Greedy's per-token pick on the CPU: `argmax`, `torch.max(dim)` and kvserve's C++ row argmax
(csrc/sampling_cpu.cpp, what sampler.row_argmax runs once the CPU kernels are loaded).

Vocabulary-wide float32 rows (the default model's 49,152) at 1, 8 and 64 rows, the engine's
threads, best of --reps calls, each call on fresh rows from a rotation of --sets sets (as a
step's logits arrive: written once by the lm_head, read once); ratios are over the kernel's
time.

    python benchmarks/bench_row_argmax.py [--reps 30]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import machine, wall_us  # noqa: E402
from benchmarks.cpu_info import cpu_flags  # noqa: E402
from kvserve.model.layers.cpu_kernels import load_cpu_kernels  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--sets", type=int, default=16)
    args = ap.parse_args()
    kernels = load_cpu_kernels()
    if kernels is None:
        print("the CPU kernels do not build here")
        return 1
    print(f"{machine()}; CPU flags: {cpu_flags()}; load average {os.getloadavg()}")
    print("| rows | argmax us | torch.max us | kvserve row_argmax us | argmax / kvserve "
          "| torch.max / kvserve |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for rows in (1, 8, 64):
        sets = [torch.randn(rows, args.vocab) for _ in range(args.sets)]
        assert all(torch.equal(x.argmax(-1), kernels.row_argmax(x)) for x in sets)
        fns = (lambda x: x.argmax(-1), lambda x: torch.max(x, -1).indices, kernels.row_argmax)
        a, m, k = (wall_us(lambda fn=fn, rot=itertools.cycle(sets): fn(next(rot)), args.reps) for fn in fns)
        print(f"| {rows} | {a:.0f} | {m:.0f} | {k:.0f} | {a / k:.2f}x | {m / k:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
