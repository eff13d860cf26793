"""What another process's CPU costs a single decoding stream, when the engine has every core.

Served at c=1 on a machine with as many cores as the engine has threads, each token wakes the
API process and the client (~0.6 ms of CPU a token on a 2-core Zen 4, bench_served_token_cpu.py),
and they run on a core an engine thread computes on. The overlapped decode stack's threads meet
at a barrier after every stage (csrc/decode_overlap_cpu.cpp), so the step waits about that
whole time; a stack whose threads could take over a stalled one's share would lose about one
core's part of it. This measures it directly: offline decoding of one ~100-token prompt, in
turns quiet and beside a competitor process that wakes every `--period-ms` and spins
`--burn-ms` (like the API process and the client after each token), the turns alternating
inside one process so the host's drift cancels. Reported per round: ms/token quiet and
contended, and the excess as a share of the competitor's CPU per token (1.0: the step waited
all of it; 0.5: one of two cores' worth).

With `--baseline-tree DIR` (another kvserve tree, e.g. `git archive <commit> | tar -x -C DIR`)
each round measures that tree too, in alternating order. Prints the CPU flags and load average.

    python benchmarks/bench_decode_interference.py [--config int4-kv8-cap64] [--rounds 3]
                                                   [--baseline-tree DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from benchmarks.bench_cpu_serve import MODEL, _engine_kwargs, config_flags  # noqa: E402
from benchmarks.bench_served_token_cpu import generate_s  # noqa: E402
from benchmarks.common import machine  # noqa: E402
from benchmarks.cpu_info import cpu_flags  # noqa: E402
from benchmarks.tree_compare import add_tree_options, compared_trees, enter_tree, in_tree_child  # noqa: E402

# The competitor: sleep a period, spin a burn, forever (killed at the end of a turn).
COMPETITOR = """
import sys, time
period, burn = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3
while True:
    time.sleep(period)
    end = time.perf_counter() + burn
    while time.perf_counter() < end:
        pass
"""


def turns(config: str, tokens: int, turns_each: int, period_ms: float, burn_ms: float) -> dict:
    """In this process: quiet and contended turns of `tokens` decoded tokens, alternating."""
    from kvserve import LLM

    llm = LLM(MODEL, kv_cache_memory="256MiB", **_engine_kwargs(config_flags(config)))

    def ms_per_token() -> float:
        return (generate_s(llm, tokens + 1) - generate_s(llm, 1)) / tokens * 1e3

    ms_per_token()  # warm-up
    quiet, contended = [], []
    for _ in range(turns_each):
        quiet.append(ms_per_token())
        rival = subprocess.Popen([sys.executable, "-c", COMPETITOR, str(period_ms), str(burn_ms)])
        try:
            time.sleep(0.2)  # it is running
            contended.append(ms_per_token())
        finally:
            rival.kill()
            rival.wait()
    return {"quiet": statistics.median(quiet), "contended": statistics.median(contended)}


def turns_in(tree: str, args) -> dict:
    """`turns` in a child process that imports kvserve from `tree`."""
    return in_tree_child(
        __file__, tree, "--config", args.config, "--tokens", str(args.tokens), "--turns", str(args.turns),
        "--period-ms", str(args.period_ms), "--burn-ms", str(args.burn_ms),
    )  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="int4-kv8-cap64", help="as bench_cpu_serve.py's --configs names one")
    ap.add_argument("--tokens", type=int, default=200, help="tokens per turn")
    ap.add_argument("--turns", type=int, default=3, help="quiet and contended turns per round, each")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--period-ms", type=float, default=5.0)
    ap.add_argument("--burn-ms", type=float, default=0.6)
    add_tree_options(ap)
    args = ap.parse_args()
    try:
        config_flags(args.config)
    except ValueError as e:
        ap.error(f"--config: {e}")
    if args.child:  # turns_in's
        enter_tree(args)
        print(json.dumps(turns(args.config, args.tokens, args.turns, args.period_ms, args.burn_ms)))
        return 0
    trees = compared_trees(ap, args)

    now = datetime.datetime.now(datetime.UTC)
    print(f"{machine()}; CPU flags: {cpu_flags()}; {now:%Y-%m-%d %H:%M} UTC")
    print(f"{args.config}; competitor: {args.burn_ms} ms of CPU every {args.period_ms} ms; "
          f"{args.turns} quiet and {args.turns} contended turns of {args.tokens} tokens a round")  # fmt: skip
    print(
        "| round | tree | quiet ms/token | contended ms/token | excess ms/token "
        "| excess / competitor's CPU a token | load |"
    )
    print("|---|---|---|---|---|---|---|")
    shares: dict[str, list[float]] = {k: [] for k in trees}
    for rnd in range(args.rounds):
        for name in list(trees) if rnd % 2 == 0 else list(reversed(trees)):
            r = turns_in(trees[name], args)
            excess = r["contended"] - r["quiet"]
            # The competitor's CPU per token: its burn per period, over the tokens of a period.
            share = excess / (args.burn_ms * r["contended"] / (args.period_ms + args.burn_ms))
            shares[name].append(share)
            print(f"| {rnd + 1} | {name} | {r['quiet']:.2f} | {r['contended']:.2f} | {excess:.2f} "
                  f"| {share:.2f} | {os.getloadavg()[0]:.2f} |", flush=True)  # fmt: skip
    for name, s in shares.items():
        print(f"{name}: median excess / competitor's CPU {statistics.median(s):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
