"""Prefix caching on vs off: 64 requests sharing a ~1,000-token system prompt.

Each request is the shared system prompt + a ~50-token question of its own, 64 output
tokens (greedy, ignore_eos), all submitted at once to the offline engine (default model,
fp32). Prints TTFT p50 and total throughput (prompt + output tokens / s) for both, from the
same run, and checks that the outputs are identical.

    python benchmarks/bench_prefix_cache.py [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import machine, make_prompts  # noqa: E402
from kvserve import LLM, SamplingParams  # noqa: E402


def run(llm: LLM, prompts: list[list[int]], output_len: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    secs = time.perf_counter() - t0
    ttfts = [o.metrics.time_to_first_token for o in outs]
    tokens = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs)
    kv = llm.llm_engine.kv_cache_manager
    return {
        "seconds": secs,
        "ttft_p50_s": statistics.median(ttfts),
        "total_tok_per_s": tokens / secs,
        "output_tok_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / secs,
        "cached_prompt_tokens": sum(o.num_cached_tokens for o in outs),
        "prefix_cache_hit_rate": kv.prefix_cache_hits / max(1, kv.prefix_cache_queries),
        "token_ids": [o.outputs[0].token_ids for o in outs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--system-len", type=int, default=1000)
    ap.add_argument("--question-len", type=int, default=50)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--json")
    args = ap.parse_args()

    results = {}
    for caching in (False, True):
        llm = LLM("smollm2-135m", kv_cache_memory="2GiB", enable_prefix_caching=caching)
        system = make_prompts(llm.tokenizer, 1, args.system_len, seed=1, jitter=0)[0]
        questions = make_prompts(llm.tokenizer, args.num_requests, args.question_len, seed=2, jitter=5)
        prompts = [system + q for q in questions]
        llm.generate([questions[0]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up, no sharing
        results["on" if caching else "off"] = run(llm, prompts, args.output_len)
        del llm

    on, off = results["on"], results["off"]
    assert on.pop("token_ids") == off.pop("token_ids"), "prefix caching changed a greedy output"
    res = {
        "date": datetime.date.today().isoformat(), "machine": machine(), "workload": vars(args),
        "prefix_caching_off": off, "prefix_caching_on": on,
        "ttft_p50_ratio_off_over_on": off["ttft_p50_s"] / on["ttft_p50_s"],
        "throughput_ratio_on_over_off": on["total_tok_per_s"] / off["total_tok_per_s"],
    }  # fmt: skip
    print(json.dumps(res, indent=1))
    print(
        f"\nTTFT p50: {off['ttft_p50_s']:.2f}s off, {on['ttft_p50_s']:.2f}s on "
        f"({res['ttft_p50_ratio_off_over_on']:.1f}x lower); total throughput {off['total_tok_per_s']:.0f} -> "
        f"{on['total_tok_per_s']:.0f} tok/s ({res['throughput_ratio_on_over_off']:.1f}x); outputs identical"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
