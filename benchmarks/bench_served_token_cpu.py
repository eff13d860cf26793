"""Where a served token's CPU goes at c=1: the engine's threads, the API process, the client.

Issue 16 asks for a c=1 inter-token latency within 10% of the offline per-token time. On a
machine with as many cores as the engine has threads, the API process and the client run on
the cores the engine computes on, so their CPU per token is what the server adds. For one
configuration, in one run:
1. offline: one ~100-token prompt decoding `--tokens` tokens in a child process (the (n+1)-token
   run minus a 1-token run), with the CPU each of its threads used per token;
2. served: the same prompt streamed from `kvserve serve` by a client in this process; the
   inter-token latency, and the CPU per token of the engine core's threads (from /proc), of
   the API process and of this client.
With `--baseline-tree DIR` (another kvserve tree, e.g. `git archive <commit> | tar -x -C DIR`)
each round measures that tree too, offline and served, the two trees in alternating order; the
last lines give each tree's medians. Prints the CPU flags and the load average.

    python benchmarks/bench_served_token_cpu.py [--config int4-kv8-cap64] [--tokens 600] [--rounds 2]
                                                [--baseline-tree DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import httpx  # noqa: E402
import psutil  # noqa: E402
from server_utils import ServerProcess  # noqa: E402

from benchmarks.bench_cpu_serve import MODEL, _engine_kwargs, config_flags  # noqa: E402
from benchmarks.common import machine  # noqa: E402
from benchmarks.cpu_info import cpu_flags  # noqa: E402
from benchmarks.tree_compare import add_tree_options, compared_trees, enter_tree, in_tree_child  # noqa: E402

PROMPT = "Tell me a long story about a cat who learns to sail. " * 8


def thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) so far of each thread of `pid`, by thread id."""
    return {t.id: t.user_time + t.system_time for t in psutil.Process(pid).threads()}


def per_token_ms(before: dict[int, float], after: dict[int, float], tokens: int) -> list[float]:
    """Each thread's CPU milliseconds per token between two readings, largest first."""
    return sorted(((after[k] - before.get(k, 0.0)) / tokens * 1e3 for k in after), reverse=True)


def generate_s(llm, n: int) -> float:
    """Seconds for PROMPT and `n` greedy tokens (ignore_eos): (n + 1) minus 1 is the decode."""
    from kvserve import SamplingParams

    t0 = time.perf_counter()
    llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return time.perf_counter() - t0


def offline(flags: list[str], tokens: int) -> dict:
    from kvserve import LLM

    llm = LLM(MODEL, kv_cache_memory="256MiB", **_engine_kwargs(flags))
    generate_s(llm, 8)  # warm-up
    c0 = thread_cpu_s(os.getpid())
    long = generate_s(llm, tokens + 1)
    c1 = thread_cpu_s(os.getpid())
    ms = (long - generate_s(llm, 1)) / tokens * 1e3
    return {"ms": ms, "threads": per_token_ms(c0, c1, tokens)[:2]}


def offline_in(tree: str, config: str, tokens: int) -> dict:
    """`offline` in a child process that imports kvserve from `tree`."""
    return in_tree_child(__file__, tree, "--config", config, "--tokens", str(tokens))


def served(flags: list[str], tokens: int, tree: str = ROOT) -> dict:
    server = ServerProcess(
        MODEL, "--kv-cache-memory", "256MiB", *flags, api_key="bench-key", timeout=300, cwd=tree
    )
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": tokens + 1, "ignore_eos": True,
            "temperature": 0, "stream": True}  # fmt: skip
    try:
        core = server.engine_core_pid()
        with httpx.Client(timeout=300, headers=server.headers) as client:

            def stream() -> list[float]:
                stamps = []
                with client.stream("POST", f"{server.url}/v1/completions", json=body) as r:
                    r.raise_for_status()
                    for line in r.iter_lines():
                        if line.startswith("data:") and "[DONE]" not in line:
                            stamps.append(time.perf_counter())
                return stamps

            stream()  # warm-up
            a0, e0, c0 = thread_cpu_s(server.proc.pid), thread_cpu_s(core), time.process_time()
            stamps = stream()
            a1, e1, c1 = thread_cpu_s(server.proc.pid), thread_cpu_s(core), time.process_time()
    finally:
        server.stop()
    n = len(stamps) - 1
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {
        "itl_p50_ms": statistics.median(gaps) * 1e3,
        "itl_mean_ms": (stamps[-1] - stamps[0]) / n * 1e3,
        "engine": per_token_ms(e0, e1, n)[:2],
        "api_ms": sum(per_token_ms(a0, a1, n)),
        "client_ms": (c1 - c0) / n * 1e3,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="int4-kv8-cap64", help="as bench_cpu_serve.py's --configs names one")
    ap.add_argument("--tokens", type=int, default=600)
    ap.add_argument("--rounds", type=int, default=2)
    add_tree_options(ap)
    args = ap.parse_args()
    try:
        flags = config_flags(args.config)
    except ValueError as e:
        ap.error(f"--config: {e}")
    if args.child:  # offline_in's
        enter_tree(args)
        print(json.dumps(offline(flags, args.tokens)))
        return 0
    trees = compared_trees(ap, args)

    now = datetime.datetime.now(datetime.timezone.utc)
    print(f"{machine()}; CPU flags: {cpu_flags()}; {now:%Y-%m-%d %H:%M} UTC")
    print(f"{args.config}, {args.tokens} tokens, c=1 streaming; servers: "
          + ", ".join(f"{k} {v}" for k, v in trees.items()))  # fmt: skip
    print("| round | server | offline ms/token (its 2 threads' CPU ms/token) "
          "| served ITL p50 / mean ms (vs offline) | engine's 2 busiest threads, CPU ms/token "
          "| API process | client | load |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    seen: dict[str, list[tuple[dict, dict]]] = {k: [] for k in trees}
    cpu = lambda ts: " + ".join(f"{t:.2f}" for t in ts)  # noqa: E731
    for rnd in range(args.rounds):
        order = list(trees) if rnd % 2 == 0 else list(reversed(trees))
        for name in order:  # each tree's offline time beside its server's, the trees alternating
            off = offline_in(trees[name], args.config, args.tokens)
            srv = served(flags, args.tokens, trees[name])
            seen[name].append((off, srv))
            ratio = srv["itl_p50_ms"] / off["ms"]
            print(f"| {rnd + 1} | {name} | {off['ms']:.2f} ({cpu(off['threads'])}) "
                  f"| {srv['itl_p50_ms']:.2f} / {srv['itl_mean_ms']:.2f} ({ratio:.2f}x) "
                  f"| {cpu(srv['engine'])} | {srv['api_ms']:.2f} | {srv['client_ms']:.2f} "
                  f"| {os.getloadavg()[0]:.2f} |",
                  flush=True)  # fmt: skip
    print("medians over the rounds:")
    for name, rs in seen.items():
        off_ms = statistics.median(off["ms"] for off, _ in rs)
        p50 = statistics.median(srv["itl_p50_ms"] for _, srv in rs)
        ratio = statistics.median(srv["itl_p50_ms"] / off["ms"] for off, srv in rs)
        api = statistics.median(srv["api_ms"] for _, srv in rs)
        client = statistics.median(srv["client_ms"] for _, srv in rs)
        print(f"  {name}: offline {off_ms:.2f} ms/token, served ITL p50 {p50:.2f} ms, ratio {ratio:.2f}x; "
              f"API process {api:.2f} ms CPU/token, client {client:.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
