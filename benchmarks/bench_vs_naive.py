"""kvserve against the naive baseline (transformers generate() per request, one at a time).

Starts `kvserve serve` and then `kvserve serve --engine naive` on the same model (never both at
once), and measures each with the `kvserve bench` load generator at concurrency 1, 8 and 32:
the same ~128-token random prompts, 128 output tokens each (greedy, ignore_eos), streaming
/v1/completions. Writes a markdown table, the latency-throughput PNG and the JSON.

    python benchmarks/bench_vs_naive.py [--png docs/bench_vs_naive.png] [--json results/bench_vs_naive.json]

Acceptance: at concurrency 32 kvserve's output throughput is >= 10x the baseline's and its
TTFT p99 is lower.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import httpx  # noqa: E402
from server_utils import ServerProcess  # noqa: E402

from benchmarks.common import machine  # noqa: E402
from kvserve.bench.datasets import DatasetConfig, build_dataset, load_bench_tokenizer  # noqa: E402
from kvserve.bench.loadgen import LoadConfig, run_load  # noqa: E402
from kvserve.bench.metrics import compute_metrics  # noqa: E402
from kvserve.bench.sweep import plot_sweep  # noqa: E402


def measure(url: str, model: str, requests, concurrency: int) -> dict:
    cfg = LoadConfig(
        url, model, max_concurrency=concurrency, ignore_eos=True, temperature=0.0, progress=False
    )
    results, duration = asyncio.run(run_load(cfg, requests))
    return compute_metrics(results, duration)


def run_server(engine: str, args, requests, points: list[tuple[int, int]]) -> list[dict]:
    extra = ["--kv-cache-memory", args.kv_cache_memory] if engine == "kvserve" else []
    server = ServerProcess(args.model, "--engine", engine, *extra, api_key=None, timeout=600)
    runs = []
    try:  # one short request first: lazy initialisation is not what we measure
        warm = {"model": args.model, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        httpx.post(f"{server.url}/v1/completions", json=warm, timeout=120).raise_for_status()
        for conc, n in points:
            m = measure(server.url, args.model, requests[:n], conc)
            print(
                f"{engine:8s} concurrency {conc:3d} ({n} prompts): {m['output_throughput']:.1f} tok/s, "
                f"TTFT p99 {m['ttft_ms']['p99']:.0f} ms, failed {m['failed']}",
                flush=True,
            )
            runs.append({"max_concurrency": conc, "num_prompts": n, "metrics": m})
    finally:
        server.stop()
    return runs


def table(series: list[dict]) -> str:
    head = (
        "| server | concurrency | prompts | output tok/s | req/s | TTFT p50 (ms) | TTFT p99 (ms) "
        "| ITL p50 (ms) | TPOT mean (ms) | e2e p50 (s) | failed |"
    )
    lines = [head, "|" + "---|" * 11]
    for s in series:
        for r in s["runs"]:
            m, c, n = r["metrics"], r["max_concurrency"], r["num_prompts"]
            lines.append(
                f"| {s['label']} | {c} | {n} | {m['output_throughput']:.1f} "
                f"| {m['request_throughput']:.3f} | {m['ttft_ms']['p50']:,.0f} | {m['ttft_ms']['p99']:,.0f} "
                f"| {m['itl_ms']['p50']:.1f} | {m['tpot_ms']['mean']:.1f} | {m['e2el_ms']['p50'] / 1000:.1f} "
                f"| {m['failed']} |"
            )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--concurrencies", default="1,8,32")
    ap.add_argument("--num-prompts", default="3,8,32", help="prompts per concurrency (same for both servers)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--png", default="docs/bench_vs_naive.png")
    ap.add_argument("--json", default="results/bench_vs_naive.json")
    args = ap.parse_args()
    points = list(zip(map(int, args.concurrencies.split(",")), map(int, args.num_prompts.split(","))))

    tok = load_bench_tokenizer(args.model)
    cfg = DatasetConfig("random", max(n for _, n in points), args.input_len, args.output_len, seed=0)
    requests = build_dataset(tok, cfg)
    series = [{"label": e, "runs": run_server(e, args, requests, points)} for e in ("kvserve", "naive")]

    plot_sweep(
        {"sweep": "max_concurrency", "series": series}, args.png,
        f"{args.model}: kvserve vs transformers generate() one at a time "
        f"({args.input_len} in / {args.output_len} out tokens; labels: concurrency)",
    )  # fmt: skip
    top = max(c for c, _ in points)
    ours, base = (next(r["metrics"] for r in s["runs"] if r["max_concurrency"] == top) for s in series)
    ratio = ours["output_throughput"] / base["output_throughput"]
    ttft_lower = ours["ttft_ms"]["p99"] < base["ttft_ms"]["p99"]
    result = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join(["python", *sys.argv]),
        "machine": machine(),
        "workload": {**vars(args), "mean_prompt_tokens": sum(r.prompt_len for r in requests) / len(requests)},
        "series": series,
        f"throughput_ratio_at_concurrency_{top}": ratio,
        f"ttft_p99_lower_at_concurrency_{top}": ttft_lower,
    }
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print()
    print(table(series))
    print(
        f"\nmean prompt tokens: {result['workload']['mean_prompt_tokens']:.1f}; machine: {result['machine']}"
    )
    print(
        f"concurrency {top}: kvserve / naive output throughput = {ratio:.1f}x (target >= 10x); "
        f"TTFT p99 {ours['ttft_ms']['p99']:,.0f} ms vs {base['ttft_ms']['p99']:,.0f} ms "
        f"({'lower' if ttft_lower else 'NOT lower'})"
    )
    print(f"plot: {args.png}; json: {args.json}")
    return 0 if ratio >= 10 and ttft_lower else 1


if __name__ == "__main__":
    sys.exit(main())
