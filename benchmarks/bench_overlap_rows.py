"""Small decode batches on the overlapped decode stack against a parallel region per kernel
(issue 16: which row counts `OVERLAP_MAX_ROWS` sends through csrc/decode_overlap_cpu.cpp).

One offline engine (default model, `--config`), its decode stack switched between the two
paths round by round (`set_overlap_rows(1)`: only one-row steps overlapped; `(n)`: steps of up
to n rows, a batch of n taking its bucket's rows: shape_buckets.py), order alternating, the runs
seconds apart: a shared host drifts by more than the difference between the paths over minutes.
Each run decodes `--batch` prompts of ~`--prompt` tokens; the time per step is the (n+1)-token
run minus the 1-token run, over n. Prints each round's ratio (overlapped over per-kernel
regions), their median and the CPU flags. With
`--split N` the overlapped steps of N rows or more share thread 0's serial work by rows
(`set_split_rows`); 0 keeps it on thread 0.

    python benchmarks/bench_overlap_rows.py [--batch 2,4,8,16,32] [--prompt 128] [--rounds 8] [--split N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_decode_roofline import decode_s  # noqa: E402
from benchmarks.bench_decode_stack_ab import CONFIGS  # noqa: E402
from benchmarks.common import make_prompts, run_header  # noqa: E402
from kvserve import LLM  # noqa: E402
from kvserve.worker.shape_buckets import padded_rows  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="int4-kv8", choices=sorted(CONFIGS))
    ap.add_argument("--batch", default="2,4,8,16,32", help="comma-separated decode batch sizes")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens (the context attention reads)")
    ap.add_argument("--tokens", type=int, default=16, help="decode steps timed per run")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--split", type=int, default=None, help="set_split_rows (default: llama.py's)")
    args = ap.parse_args()
    print(run_header())

    llm = LLM("smollm2-135m", kv_cache_memory="512MiB", max_model_len=8192, **CONFIGS[args.config])
    model = llm.llm_engine.model_runner.model
    split = "llama.py's" if args.split is None else args.split
    print(
        f"{args.config}, prompts of ~{args.prompt} tokens, {args.tokens} decode steps a run, split rows "
        f"{split}; ms per step"
    )
    print("| batch | per-kernel regions | overlapped | ratio, median (range) | rounds below 1 |")
    print("|---|---|---|---|---|")
    for batch in (int(b) for b in args.batch.split(",")):
        if batch < 2:
            sys.exit(f"--batch {batch}: one row is overlapped either way; give sizes above 1")
        prompts = make_prompts(llm.tokenizer, batch, args.prompt, seed=1)
        decode_s(llm, prompts, 3)  # builds the stack (model._stack) and caches the prompts' prefixes
        stack = model._stack[1]
        if args.split is not None:
            stack.set_split_rows(args.split)
        ms: dict[int, list[float]] = {1: [], batch: []}
        for rnd in range(args.rounds):
            for rows in (1, batch) if rnd % 2 == 0 else (batch, 1):
                stack.set_overlap_rows(padded_rows(rows))  # a batch of n runs as its bucket's rows
                ms[rows].append(decode_s(llm, prompts, args.tokens) * 1e3)
        ratios = [b / a for a, b in zip(ms[1], ms[batch])]
        print(f"| {batch} | {statistics.median(ms[1]):.2f} | {statistics.median(ms[batch]):.2f} | "
              f"{statistics.median(ratios):.3f}x ({min(ratios):.3f}-{max(ratios):.3f}) | "
              f"{sum(r < 1 for r in ratios)} of {len(ratios)} |", flush=True)  # fmt: skip
    print(f"load average {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
