"""Where a served token's CPU goes at c=1: the engine's threads, the API process, the client.

Issue 16 asks for a c=1 inter-token latency within 10% of the offline per-token time. On a
machine with as many cores as the engine has threads, the API process and the client run on
the cores the engine computes on, so their CPU per token is what the server adds. Each round
starts two processes for one configuration and keeps both alive:
1. an offline engine (`LLM`) in a child process, which decodes one ~100-token prompt for
   `--tokens` tokens when asked (the (n+1)-token run minus a 1-token run), with the CPU each
   of its threads used per token;
2. `kvserve serve`, from which a client in this process streams the same prompt; the
   inter-token latency, and the CPU per token of the engine core's threads (from /proc), of
   the API process and of this client.
Then `--segments` times, one offline run and one served stream back to back (their order
alternating), each served ITL p50 taken against the offline time next to it. A shared host's
speed drifts by tens of percent within minutes, more than the server adds, so the ratio is
read from runs seconds apart and the median of the round's segments is reported.
With `--baseline-tree DIR` (another kvserve tree, e.g. `git archive <commit> | tar -x -C DIR`)
each round measures that tree too, the two trees in alternating order; the last lines give
each tree's medians. Prints the CPU flags and the load average.

    python benchmarks/bench_served_token_cpu.py [--config int4-kv8-cap64] [--tokens 300] [--rounds 2]
                                                [--segments 5] [--baseline-tree DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import httpx  # noqa: E402
import psutil  # noqa: E402
from server_utils import ServerProcess  # noqa: E402

from benchmarks.bench_cpu_serve import MODEL, _engine_kwargs, config_flags  # noqa: E402
from benchmarks.common import machine  # noqa: E402
from benchmarks.cpu_info import cpu_flags  # noqa: E402
from benchmarks.tree_compare import add_tree_options, compared_trees, enter_tree  # noqa: E402

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


def offline_worker(flags: list[str]) -> None:
    """The child: an offline engine answering each line of stdin (a token count) with one JSON
    line: decode ms a token and its two busiest threads' CPU ms a token."""
    from kvserve import LLM

    llm = LLM(MODEL, kv_cache_memory="256MiB", **_engine_kwargs(flags))
    generate_s(llm, 8)  # warm-up
    print("ready", flush=True)
    for line in sys.stdin:
        tokens = int(line)
        c0 = thread_cpu_s(os.getpid())
        long = generate_s(llm, tokens + 1)
        c1 = thread_cpu_s(os.getpid())
        ms = (long - generate_s(llm, 1)) / tokens * 1e3
        print(json.dumps({"ms": ms, "threads": per_token_ms(c0, c1, tokens)[:2]}), flush=True)


@contextlib.contextmanager
def offline_engine(tree: str, config: str) -> Iterator[Callable[[int], dict]]:
    """A function running `offline_worker`'s measurement for n tokens in a child that imports
    kvserve from `tree` and stays up between calls."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--tree", tree, "--config", config]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the offline engine ({tree}) did not start")

        def measure(tokens: int) -> dict:
            proc.stdin.write(f"{tokens}\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the offline engine ({tree}) exited (rc {proc.wait()})")
            return json.loads(line)

        yield measure
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)


@contextlib.contextmanager
def served_engine(flags: list[str], tree: str) -> Iterator[Callable[[int], dict]]:
    """A function streaming n tokens from a `kvserve serve` of `tree` at c=1 (the server stays
    up between calls): ITL p50 / mean and the CPU per token of each process."""
    server = ServerProcess(
        MODEL, "--kv-cache-memory", "256MiB", *flags, api_key="bench-key", timeout=300, cwd=tree
    )
    try:
        core = server.engine_core_pid()
        with httpx.Client(timeout=300, headers=server.headers) as client:

            def stream(tokens: int) -> list[float]:
                body = {"model": MODEL, "prompt": PROMPT, "max_tokens": tokens + 1, "ignore_eos": True,
                        "temperature": 0, "stream": True}  # fmt: skip
                stamps = []
                with client.stream("POST", f"{server.url}/v1/completions", json=body) as r:
                    r.raise_for_status()
                    for line in r.iter_lines():
                        if line.startswith("data:") and "[DONE]" not in line:
                            stamps.append(time.perf_counter())
                return stamps

            def measure(tokens: int) -> dict:
                a0, e0, c0 = thread_cpu_s(server.proc.pid), thread_cpu_s(core), time.process_time()
                stamps = stream(tokens)
                a1, e1, c1 = thread_cpu_s(server.proc.pid), thread_cpu_s(core), time.process_time()
                n = len(stamps) - 1
                gaps = [b - a for a, b in zip(stamps, stamps[1:])]
                return {
                    "itl_p50_ms": statistics.median(gaps) * 1e3,
                    "itl_mean_ms": (stamps[-1] - stamps[0]) / n * 1e3,
                    "engine": per_token_ms(e0, e1, n)[:2],
                    "api_ms": sum(per_token_ms(a0, a1, n)),
                    "client_ms": (c1 - c0) / n * 1e3,
                }

            stream(8)  # warm-up
            yield measure
    finally:
        server.stop()


def measure_round(
    tree: str, config: str, flags: list[str], tokens: int, segments: int
) -> list[tuple[dict, dict]]:
    """`segments` pairs of (offline, served) runs of `tokens` tokens, back to back, the order
    alternating within the round."""
    pairs = []
    with offline_engine(tree, config) as off, served_engine(flags, tree) as srv:
        for seg in range(segments):
            if seg % 2 == 0:
                o = off(tokens)
                s = srv(tokens)
            else:
                s = srv(tokens)
                o = off(tokens)
            pairs.append((o, s))
    return pairs


def med(xs) -> float:
    return statistics.median(list(xs))


def summary(pairs: list[tuple[dict, dict]]) -> dict[str, float]:
    """The served runs' medians of their single-number figures."""
    keys = ("itl_p50_ms", "itl_mean_ms", "api_ms", "client_ms")
    return {k: med(s[k] for _, s in pairs) for k in keys}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="int4-kv8-cap64", help="as bench_cpu_serve.py's --configs names one")
    ap.add_argument("--tokens", type=int, default=300, help="tokens a segment decodes, offline and served")
    ap.add_argument("--segments", type=int, default=5, help="(offline, served) pairs a round")
    ap.add_argument("--rounds", type=int, default=2)
    add_tree_options(ap)
    args = ap.parse_args()
    try:
        flags = config_flags(args.config)
    except ValueError as e:
        ap.error(f"--config: {e}")
    if args.child:  # offline_engine's
        enter_tree(args)
        offline_worker(flags)
        return 0
    trees = compared_trees(ap, args)

    now = datetime.datetime.now(datetime.UTC)
    print(f"{machine()}; CPU flags: {cpu_flags()}; {now:%Y-%m-%d %H:%M} UTC")
    print(f"{args.config}, {args.segments} segments of {args.tokens} tokens a round, c=1 streaming; "
          "servers: " + ", ".join(f"{k} {v}" for k, v in trees.items()))  # fmt: skip
    print("| round | server | offline ms/token (its 2 threads' CPU ms/token) | served ITL p50 / mean ms "
          "| served p50 / offline beside it: median (range) | engine's 2 busiest threads, CPU ms/token "
          "| API process | client | load |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    seen: dict[str, list[tuple[dict, dict]]] = {k: [] for k in trees}
    cpu = lambda ts: " + ".join(f"{t:.2f}" for t in ts)  # noqa: E731
    for rnd in range(args.rounds):
        order = list(trees) if rnd % 2 == 0 else list(reversed(trees))
        for name in order:
            pairs = measure_round(trees[name], args.config, flags, args.tokens, args.segments)
            seen[name] += pairs
            ratios = [s["itl_p50_ms"] / o["ms"] for o, s in pairs]
            threads = [med(o["threads"][i] for o, _ in pairs) for i in range(2)]
            engine = [med(s["engine"][i] for _, s in pairs) for i in range(2)]
            off_ms, srv = med(o["ms"] for o, _ in pairs), summary(pairs)
            print(f"| {rnd + 1} | {name} | {off_ms:.2f} ({cpu(threads)}) "
                  f"| {srv['itl_p50_ms']:.2f} / {srv['itl_mean_ms']:.2f} "
                  f"| {med(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) | {cpu(engine)} "
                  f"| {srv['api_ms']:.2f} | {srv['client_ms']:.2f} | {os.getloadavg()[0]:.2f} |",
                  flush=True)  # fmt: skip
    print("medians over every segment:")
    for name, pairs in seen.items():
        ratios = sorted(s["itl_p50_ms"] / o["ms"] for o, s in pairs)
        within = sum(r <= 1.10 for r in ratios)
        srv = summary(pairs)
        print(f"  {name}: offline {med(o['ms'] for o, _ in pairs):.2f} ms/token, served ITL p50 "
              f"{srv['itl_p50_ms']:.2f} ms, ratio {med(ratios):.2f}x ({within} of {len(ratios)} "
              f"segments within 1.10x); API process {srv['api_ms']:.2f} ms CPU/token, "
              f"client {srv['client_ms']:.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
