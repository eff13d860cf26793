"""Issue 16's server figures: each weight format through `kvserve serve`, ratios against fp32.

For every configuration (a name and the `kvserve serve` flags it adds), in one run:
1. offline per-token decode time at one sequence (`LLM`, the (n+1)-token run minus a 1-token
   run, best of `--offline-rounds`), the yardstick for the server's c=1 inter-token latency
   (issue 16: "c=1 ITL within 10% of the offline per-token time"; that ratio here compares
   runs minutes apart, bench_served_token_cpu.py's compares runs seconds apart);
2. the server at c=1: `--c1-requests` streamed completions, one at a time;
3. the server at c=32: `--requests` (64) streamed completions of ~100-token prompts and 128
   output tokens (ignore_eos), at most 32 in flight (issue 16: output throughput >= 2x the
   fp32 configuration, ITL p99 <= 3x ITL p50). Every configuration's server stays up, and the
   c=32 runs go round the configurations `--rounds` times, the order reversed each round, each
   round with prompts of its own (none any server has cached): a shared host's speed drifts by
   tens of percent within minutes, so each round's throughput is taken against the fp32 run
   next to it, and the table gives the medians.
The load generator is `kvserve bench serve` in its own process. Prints the CPU flags and the
load average beside every table.

    python benchmarks/bench_cpu_serve.py [--configs fp32,int4,int8-kv8-cap128] [--rounds 3]
                                         [--json out.json]

A configuration is named by its weights (fp32, int4, int8, bf16), then optionally `-kv8` (int8
KV cache) and `-capN` (`--long-prefill-token-threshold N`).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from server_utils import ServerProcess  # noqa: E402

from benchmarks.common import machine, make_prompts  # noqa: E402
from benchmarks.cpu_info import cpu_flags  # noqa: E402

MODEL = "smollm2-135m"
WEIGHTS: dict[str, list[str]] = {
    "fp32": [],
    "int4": ["--quantization", "int4"],
    "int8": ["--quantization", "int8"],
    "bf16": ["--dtype", "bfloat16"],
}


def config_flags(name: str) -> list[str]:
    """A configuration's `kvserve serve` flags from its name: weights (fp32 | int4 | int8 |
    bf16), then optionally `-kv8` (int8 KV cache) and `-capN` (`--long-prefill-token-threshold
    N`), e.g. int4-kv8-cap128. ValueError names what is wrong."""
    weights, *rest = name.split("-")
    if weights not in WEIGHTS:
        raise ValueError(f"{name!r}: weights must be one of {', '.join(WEIGHTS)}")
    flags = list(WEIGHTS[weights])
    for part in rest:
        if part == "kv8":
            flags += ["--kv-cache-dtype", "int8"]
        elif part.startswith("cap") and part[3:].isdigit():
            flags += ["--long-prefill-token-threshold", part[3:]]
        else:
            raise ValueError(f"{name!r}: {part!r} is neither kv8 nor capN")
    return flags


def _engine_kwargs(flags: list[str]) -> dict:
    """The LLM keyword arguments matching a configuration's server flags."""
    kw, it = {}, iter(flags)
    for flag in it:
        kw[flag.removeprefix("--").replace("-", "_")] = next(it)
    if "long_prefill_token_threshold" in kw:
        kw["long_prefill_token_threshold"] = int(kw["long_prefill_token_threshold"])
    return kw


def offline_ms_per_token(flags: list[str], output_len: int, rounds: int) -> float:
    """One sequence's decode time per token in this process (no server, no HTTP)."""
    from kvserve import LLM, SamplingParams

    llm = LLM(MODEL, kv_cache_memory="256MiB", **_engine_kwargs(flags))
    prompt = make_prompts(llm.tokenizer, 1, 100, seed=3)

    def run(n: int) -> float:
        t0 = time.perf_counter()
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t0

    run(4)  # warm-up
    return min(run(output_len + 1) - run(1) for _ in range(rounds)) / output_len * 1000


def bench_serve(url: str, concurrency: int, requests: int, output_len: int, out: str,
                extra: list[str] | None = None, seed: int = 7) -> dict:  # fmt: skip
    """One `kvserve bench serve` run (with `extra` arguments) of random prompts from `seed`; its
    saved result. A server that saw the same seed's prompts serves them from its prefix cache."""
    cmd = [
        sys.executable, "-m", "kvserve.entrypoints.cli", "bench", "serve", "--base-url", url,
        "--model", MODEL, "--api-key", "bench-key", "--dataset", "random", "--input-len", "100",
        "--output-len", str(output_len), "--range-ratio", "0.1", "--num-prompts", str(requests),
        "--max-concurrency", str(concurrency), "--request-rate", "inf", "--ignore-eos",
        "--warmup", "2", "--disable-tqdm", "--seed", str(seed), "--save-result", out, *(extra or []),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        tail = (done.stdout + done.stderr)[-2000:]
        raise RuntimeError(f"kvserve bench serve failed ({done.returncode}): {tail}")
    with open(out) as f:
        return json.load(f)


def run_figures(tag: str, res: dict) -> dict:
    """Throughput, ITL and TTFT of one run's saved result, keys prefixed by `tag`; RuntimeError
    if any request failed."""
    m = res.get("metrics", res)
    if m.get("failed"):
        raise RuntimeError(f"{tag}: {m['failed']} requests failed: {m.get('errors')}")
    return {
        f"{tag}_tok_s": m["output_throughput"],
        f"{tag}_out_tokens": m.get("total_output_tokens"),
        f"{tag}_itl_p50_ms": m["itl_ms"]["p50"],
        f"{tag}_itl_p99_ms": m["itl_ms"]["p99"],
        f"{tag}_ttft_p50_ms": m["ttft_ms"]["p50"],
    }


def load_figures(name: str, c1: dict, c32: dict) -> dict:
    """`run_figures` of a c=1 and a c=32 run (keys c1_*, c32_*); RuntimeError naming `name` if
    any request failed."""
    try:
        return {**run_figures("c1", c1), **run_figures("c32", c32)}
    except RuntimeError as e:
        raise RuntimeError(f"{name} {e}") from None


def save_json(path: str, args, results: dict) -> None:
    """The run's results beside the machine, its CPU flags and the arguments."""
    with open(path, "w") as f:
        record = {"machine": machine(), "flags": cpu_flags(), "args": vars(args), "results": results}
        json.dump(record, f, indent=2)


def c32_round(
    servers: dict[str, ServerProcess], order: list[str], args, tmp: str, rnd: int
) -> dict[str, dict]:
    """One c=32 run on each configuration's server, in `order`."""
    runs = {}
    for name in order:
        out = os.path.join(tmp, f"{name}-c32-{rnd}.json")
        # Each round its own prompts (and not the c=1 run's): a server's prefix cache would serve
        # the prompts of a round before it without their prefill.
        res = bench_serve(servers[name].url, 32, args.requests, args.output_len, out, seed=100 + rnd)
        r = run_figures("c32", res)
        r["c32_itl_p99_over_p50"] = r["c32_itl_p99_ms"] / r["c32_itl_p50_ms"]
        runs[name] = r
    return runs


def round_line(runs: dict[str, dict]) -> str:
    """A c=32 round's throughputs (against its fp32 run) and ITL p99/p50, one configuration after
    another."""
    base = runs.get("fp32")
    parts = []
    for name, r in runs.items():
        vs = f" ({r['c32_tok_s'] / base['c32_tok_s']:.2f}x)" if base else ""
        parts.append(f"{name} {r['c32_tok_s']:.1f} tok/s{vs} p99/p50 {r['c32_itl_p99_over_p50']:.1f}x")
    return ", ".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="fp32,int4,bf16", help=config_flags.__doc__.split(".")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--c1-requests", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--offline-rounds", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3, help="c=32 runs of each configuration, alternating")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    try:
        configs = {name: config_flags(name) for name in args.configs.split(",")}
    except ValueError as e:
        ap.error(f"--configs: {e}")

    results: dict[str, dict] = {}
    for name, flags in configs.items():
        ms = offline_ms_per_token(flags, args.output_len, args.offline_rounds)
        results[name] = {"offline_ms_per_token": ms}
        gc.collect()  # the offline engine is gone before the servers start
    servers: dict[str, ServerProcess] = {}
    rounds: list[dict[str, dict]] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name, flags in configs.items():
                servers[name] = ServerProcess(
                    MODEL, "--kv-cache-memory", "1GiB", *flags, api_key="bench-key", timeout=300
                )
            for name, r in results.items():
                out = os.path.join(tmp, f"{name}-c1.json")
                c1 = bench_serve(servers[name].url, 1, args.c1_requests, args.output_len, out)
                r.update(run_figures("c1", c1))
                r["c1_itl_vs_offline"] = r["c1_itl_p50_ms"] / r["offline_ms_per_token"]
                print(name, json.dumps({k: round(v, 3) for k, v in r.items()}), flush=True)
            for rnd in range(args.rounds):
                order = list(configs) if rnd % 2 == 0 else list(reversed(configs))
                rounds.append(c32_round(servers, order, args, tmp, rnd))
                load = os.getloadavg()[0]
                print(f"c=32 round {rnd + 1}: {round_line(rounds[-1])}; load {load:.2f}", flush=True)
    finally:
        for server in servers.values():
            server.stop()
    for name, r in results.items():  # each c=32 figure: its median over the rounds
        for key in rounds[0][name]:
            values = [run[name][key] for run in rounds if run[name][key] is not None]
            r[key] = statistics.median(values) if values else None
        if "fp32" in configs:
            r["c32_vs_fp32"] = sorted(run[name]["c32_tok_s"] / run["fp32"]["c32_tok_s"] for run in rounds)

    print(f"\n{machine()}; CPU flags: {cpu_flags()}; load average {os.getloadavg()[0]:.2f}; "
          f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; c=32 figures: medians "
          f"of {args.rounds} rounds")  # fmt: skip
    print("| config | offline ms/token | c=1 tok/s | c=1 ITL p50 (vs offline) | c=32 tok/s (vs fp32: median, "
          "range) | c=32 ITL p50 / p99 (p99/p50) | c=32 TTFT p50 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        ratios = r.get("c32_vs_fp32")
        vs = f" ({statistics.median(ratios):.2f}x, {ratios[0]:.2f}-{ratios[-1]:.2f})" if ratios else ""
        print(f"| {name} | {r['offline_ms_per_token']:.1f} | {r['c1_tok_s']:.1f} | "
              f"{r['c1_itl_p50_ms']:.1f} ms ({r['c1_itl_vs_offline']:.2f}x) | {r['c32_tok_s']:.1f}{vs} | "
              f"{r['c32_itl_p50_ms']:.0f} / {r['c32_itl_p99_ms']:.0f} ms "
              f"({r['c32_itl_p99_over_p50']:.1f}x) | "
              f"{r['c32_ttft_p50_ms']:.0f} ms |")  # fmt: skip
    if args.json:
        save_json(args.json, args, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
