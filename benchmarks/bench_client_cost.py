"""What `kvserve bench serve`'s load generator costs the machine it measures, per tree.

On a 2-core machine the client shares the cores with the server under test, so every
microsecond of client CPU a streamed chunk is taken from the server. This starts one server
(make serve's int4-kv8-cap64 by default), then runs the load generator in a child process per
tree, in alternating order: `--requests` streamed completions of ~100-token prompts and
`--tokens` outputs, `--concurrency` at a time, each round its own prompts (no prefix-cache
hits). Each child reports its own CPU time over the load (process_time: the event loop, HTTP
parsing, SSE decoding; its two warm-up requests included) per streamed chunk, and the server's
output throughput over the timed part. With
`--baseline-tree DIR` (e.g. `git archive <rev> | tar -x -C DIR`) the older client is measured
beside this one against the same server. Prints the CPU flags.

    python benchmarks/bench_client_cost.py [--rounds 4] [--baseline-tree DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from benchmarks.bench_cpu_serve import MODEL, config_flags  # noqa: E402
from benchmarks.common import run_header  # noqa: E402
from benchmarks.tree_compare import add_tree_options, answer_child, compared_trees, in_tree_child  # noqa: E402


def measure(args) -> dict:
    """In a child: one timed load from this tree's client; its CPU per chunk and throughput."""
    from kvserve.bench.datasets import DatasetConfig, build_dataset, load_bench_tokenizer
    from kvserve.bench.loadgen import LoadConfig, run_load

    tok = load_bench_tokenizer(MODEL)
    ds = DatasetConfig(name="random", num_prompts=args.requests, input_len=100, output_len=args.tokens,
                       range_ratio=0.1, seed=args.seed)  # fmt: skip
    requests = build_dataset(tok, ds)
    cfg = LoadConfig(args.url, MODEL, max_concurrency=args.concurrency, ignore_eos=True, progress=False)
    cpu0 = time.process_time()
    results, duration = asyncio.run(run_load(cfg, requests, warmup=2))
    cpu = time.process_time() - cpu0
    if not all(r.success for r in results):
        raise RuntimeError(next(r.error for r in results if not r.success))
    chunks = sum(len(r.itl) + 1 for r in results)
    tokens = sum(r.output_tokens for r in results)
    return {"cpu_us_per_chunk": cpu / chunks * 1e6, "cpu_share": cpu / duration, "tok_s": tokens / duration}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="int4-kv8-cap64", help="as bench_cpu_serve.py names them")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    add_tree_options(ap)
    args = ap.parse_args()
    if answer_child(args, measure):
        return 0
    trees = compared_trees(ap, args)
    from server_utils import ServerProcess

    print(run_header())
    print(f"server {args.config}; {args.requests} x ~100-token prompts, {args.tokens} tokens, "
          f"c={args.concurrency}")  # fmt: skip
    print("| round | tree | client CPU us / chunk | client CPU (% of a core) | served tok/s |")
    print("|---|---|---|---|---|")
    flags = config_flags(args.config)
    server = ServerProcess(MODEL, "--kv-cache-memory", "1GiB", *flags, api_key=None, timeout=300)
    results: dict[str, list[dict]] = {name: [] for name in trees}
    try:
        for rnd in range(args.rounds):
            for i, name in enumerate(list(trees) if rnd % 2 == 0 else list(reversed(trees))):
                seed = 1000 + 10 * rnd + i  # a fresh set of prompts every run
                r = in_tree_child(__file__, trees[name], "--url", server.url, "--seed", str(seed),
                                  "--requests", str(args.requests), "--tokens", str(args.tokens),
                                  "--concurrency", str(args.concurrency))  # fmt: skip
                results[name].append(r)
                print(f"| {rnd + 1} | {name} | {r['cpu_us_per_chunk']:.1f} | {100 * r['cpu_share']:.1f} | "
                      f"{r['tok_s']:.1f} |", flush=True)  # fmt: skip
    finally:
        server.stop()
    med = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in results.items()}
    for name, m in med.items():
        print(f"{name}: median {m['cpu_us_per_chunk']:.1f} us of client CPU a chunk "
              f"({100 * m['cpu_share']:.1f}% of a core), served {m['tok_s']:.1f} tok/s")  # fmt: skip
    if "baseline" in med:
        b, t = med["baseline"], med["this tree"]
        pairs = [a["tok_s"] / c["tok_s"] for a, c in zip(results["this tree"], results["baseline"])]
        cost = t["cpu_us_per_chunk"] / b["cpu_us_per_chunk"]
        print(f"this tree / baseline: client CPU a chunk {cost:.2f}x; "
              f"served tok/s per round {[round(p, 3) for p in pairs]}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
