"""Greedy's per-token pick on the CPU: `argmax` against `torch.max(dim)` (sampler.row_argmax).

Vocabulary-wide float32 rows (the default model's 49,152) at 1, 8 and 64 rows, the engine's
threads, best of --reps calls; the ratio is argmax's time over row_argmax's.

    python benchmarks/bench_row_argmax.py [--reps 30]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import machine, wall_us  # noqa: E402
from benchmarks.cpu_info import cpu_flags  # noqa: E402
from kvserve.model.layers.sampler import row_argmax  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--vocab", type=int, default=49152)
    args = ap.parse_args()
    print(f"{machine()}; CPU flags: {cpu_flags()}; load average {os.getloadavg()}")
    print("| rows | argmax us | row_argmax (torch.max) us | ratio |")
    print("|---|---|---|---|")
    for rows in (1, 8, 64):
        x = torch.randn(rows, args.vocab)
        assert torch.equal(x.argmax(-1), row_argmax(x))
        a = wall_us(lambda x=x: x.argmax(-1), args.reps)
        m = wall_us(lambda x=x: row_argmax(x), args.reps)
        print(f"| {rows} | {a:.0f} | {m:.0f} | {a / m:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
