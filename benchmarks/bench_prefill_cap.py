"""Inter-token latency of decoding streams while long prompts arrive, with and without
`long_prefill_token_threshold` (issue 16, steady ITL).

Offline engine, default model: `--streams` requests decode (short prompts, `--output-len`
tokens each) while a `--long-len`-token prompt arrives every `--every` steps. A decoding
stream's inter-token latency is the wall time of a step that gives it a token; p50 / p99 /
max are over all such (stream, step) pairs. Each cap value runs in alternating rounds in the
same process (the machine is shared); ratios are against the uncapped engine. Also printed:
the long prompts' mean time to first token (what the cap trades for steady decodes).

    python benchmarks/bench_prefill_cap.py [--caps 0,64,128] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from benchmarks.common import machine, make_prompts  # noqa: E402
from benchmarks.cpu_info import cpu_flags  # noqa: E402
from kvserve import LLM, SamplingParams  # noqa: E402


def run_once(llm: LLM, args, tag: str, rnd: int) -> dict:
    """One round; its prompts are new to the engine (seeded by round), so no long prompt is a
    prefix-cache hit that would skip the prefill being measured."""
    engine = llm.llm_engine
    tok = llm.tokenizer
    short = make_prompts(tok, args.streams, 16, seed=100 + rnd, jitter=2)
    longs = make_prompts(tok, args.num_long, args.long_len, seed=200 + rnd, jitter=8)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    long_params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i, p in enumerate(short):
        engine.add_request(f"{tag}-s{i}", p, params)
    itl, ttft, arrived = [], [], {}
    step, next_long = 0, 0
    warm = True  # the streams' own prefill steps are not inter-token gaps
    while engine.has_unfinished_requests():
        if not warm and step % args.every == 0 and next_long < len(longs):
            rid = f"{tag}-l{next_long}"
            engine.add_request(rid, longs[next_long], long_params)
            arrived[rid] = time.perf_counter()
            next_long += 1
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        got = [o for o in outs if "-s" in o.request_id]
        if warm and got and all(len(o.outputs[0].token_ids) >= 1 for o in got) and len(got) == args.streams:
            warm = False
        elif not warm:
            itl.extend([dt] * len(got))
        for o in outs:
            if o.request_id in arrived and len(o.outputs[0].token_ids) == 1:
                ttft.append(time.perf_counter() - arrived.pop(o.request_id))
        step += 1
    a = np.array(itl) * 1e3
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)), "max": float(a.max()),
            "ttft_ms": float(np.mean(ttft)) * 1e3 if ttft else float("nan")}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--caps", default="0,64,128")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--long-len", type=int, default=400)
    ap.add_argument("--num-long", type=int, default=6)
    ap.add_argument("--every", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    caps = [int(c) for c in args.caps.split(",")]
    llms = {c: LLM("smollm2-135m", kv_cache_memory="256MiB", long_prefill_token_threshold=c) for c in caps}
    results: dict[int, list[dict]] = {c: [] for c in caps}
    for rnd in range(args.rounds):
        for c, llm in llms.items():
            r = run_once(llm, args, f"r{rnd}c{c}", rnd)
            results[c].append(r)
            print(f"round {rnd + 1} cap {c}: " + ", ".join(f"{k} {v:.1f}" for k, v in r.items()), flush=True)
    print(f"\n{machine()}; CPU flags: {cpu_flags()}; load average {os.getloadavg()[0]:.2f}")
    print(f"{args.streams} decoding streams, a {args.long_len}-token prompt every {args.every} steps "
          f"({args.num_long} of them); medians over {args.rounds} rounds")  # fmt: skip
    print("| long_prefill_token_threshold | ITL p50 ms | ITL p99 ms | p99 / p50 | max ms | long TTFT ms |")
    print("|---|---|---|---|---|---|")
    for c in caps:
        m = {k: float(np.median([r[k] for r in results[c]])) for k in results[c][0]}
        name = "off" if c == 0 else str(c)
        print(f"| {name} | {m['p50']:.1f} | {m['p99']:.1f} | {m['p99'] / m['p50']:.2f} | {m['max']:.1f} "
              f"| {m['ttft_ms']:.0f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
