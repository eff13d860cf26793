"""Decode speed of every weight format, same run (issue: quantization).

For fp32, bf16, int8, int4 and fp8 weights on the default model: single-request decode
tokens/s (one ~128-token prompt, 64 greedy tokens; decode time = time of a 65-token run minus
a 1-token run) and 32-way throughput (32 prompts of ~128 tokens x 64 output tokens submitted
at once; output tokens / wall time). Ratios are against fp32 from the same run.

    python benchmarks/bench_quant_speed.py [--formats fp32,int8] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import machine, make_prompts  # noqa: E402
from kvserve import LLM, SamplingParams  # noqa: E402

FORMATS = {
    "fp32": {},
    "bf16": {"dtype": "bfloat16"},
    "int8": {"quantization": "int8"},
    "int4": {"quantization": "int4"},
    "fp8": {"quantization": "fp8"},
}


def _run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - t0


def measure(llm: LLM, args) -> dict:
    prompts = make_prompts(llm.tokenizer, args.batch, args.prompt_len, seed=1)
    _run(llm, prompts[:1], 4)  # warm-up
    singles = []
    for p in prompts[:2]:
        _, t1 = _run(llm, [p], 1)
        n, tn = _run(llm, [p], args.output_len + 1)
        singles.append((n - 1) / (tn - t1))
    tokens, secs = _run(llm, prompts, args.output_len)
    return {"single_decode_tok_s": sum(singles) / len(singles), "batch_tok_s": tokens / secs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    rows = []
    for name in args.formats.split(","):
        llm = LLM("smollm2-135m", kv_cache_memory="512MiB", **FORMATS[name])
        r = {"format": name, **measure(llm, args)}
        rows.append(r)
        single, batch = r["single_decode_tok_s"], r["batch_tok_s"]
        print(f"{name:>5}: single {single:.1f} tok/s, {args.batch}-way {batch:.1f} tok/s")
        del llm
        gc.collect()

    base = next((r for r in rows if r["format"] == "fp32"), rows[0])
    print(f"\n{machine()}, {datetime.date.today()}")
    print(f"| weights | single-request decode tok/s (vs fp32) | {args.batch}-way output tok/s (vs fp32) |")
    print("|---|---|---|")
    for r in rows:
        s, b = r["single_decode_tok_s"], r["batch_tok_s"]
        print(
            f"| {r['format']} | {s:.1f} ({s / base['single_decode_tok_s']:.2f}x) "
            f"| {b:.1f} ({b / base['batch_tok_s']:.2f}x) |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "args": vars(args), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
