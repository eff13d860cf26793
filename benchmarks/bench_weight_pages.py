"""Decode with the weights in 2 MiB pages against the same weights in 4 KiB pages, in one
process (issue 16: platform/huge_pages.weights_in_huge_pages).

The engine moves its large weights into one huge-page arena at start. Here the same engine
also holds a copy of each in ordinary pages, and rounds alternate between the two (each
tensor's `.data` swapped, the decode stack rebuilt), so the host's drift falls on both alike.
Per round: decode time per token of one ~128-token sequence and per step of `--batch`
sequences (an (n+1)-token run minus a 1-token run, over n), for `--formats`.

    python benchmarks/bench_weight_pages.py [--formats int4-kv8,int8,fp32] [--rounds 8]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_decode_roofline import FORMATS, decode_s  # noqa: E402
from benchmarks.common import machine, make_prompts  # noqa: E402
from benchmarks.cpu_info import cpu_flags  # noqa: E402
from kvserve import LLM  # noqa: E402


def thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", default="int4-kv8,int8,fp32")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32, help="decode steps timed per run")
    args = ap.parse_args()
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{machine()}; CPU flags: {cpu_flags()}; transparent huge pages: {thp_mode()}; {now}")
    for fmt in args.formats.split(","):
        llm = LLM("smollm2-135m", **FORMATS[fmt])
        model = llm.llm_engine.model_runner.model
        tensors = [t for t in itertools.chain(model.parameters(), model.buffers()) if t.nbytes >= 64 << 10]
        placed = {"huge pages": [t.data for t in tensors], "4 KiB pages": [t.data.clone() for t in tensors]}
        storages = [t.untyped_storage().data_ptr() for t in placed["huge pages"]]
        arena = max(set(storages), key=storages.count)  # the storage most of them share
        moved = sum(t.nbytes for t, s in zip(tensors, storages) if s == arena)
        print(f"{fmt}: {len(tensors)} weight tensors of 64 KiB or more, {moved / 2**20:.1f} MiB in one arena")
        for rows, n in ((1, args.tokens), (args.batch, max(4, args.tokens // 2))):
            prompts = make_prompts(llm.tokenizer, rows, 128)
            times: dict[str, list[float]] = {name: [] for name in placed}
            for _ in range(args.rounds):
                for name, data in placed.items():
                    for t, d in zip(tensors, data):
                        t.data = d
                    model.use_cpu_kernels(model.ops)  # the decode stack is built again over them
                    times[name].append(decode_s(llm, prompts, n))
            best = {name: min(t) for name, t in times.items()}
            med = {name: statistics.median(t) for name, t in times.items()}
            cells = "; ".join(f"{k} best {best[k] * 1e3:.2f} ms, median {med[k] * 1e3:.2f}" for k in placed)
            ratio = best["huge pages"] / best["4 KiB pages"], med["huge pages"] / med["4 KiB pages"]
            print(f"  {rows} sequence(s): {cells}; huge / 4 KiB: best {ratio[0]:.3f}x, med {ratio[1]:.3f}x")
        del llm, model, tensors, placed
    return 0


if __name__ == "__main__":
    sys.exit(main())
