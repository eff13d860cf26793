"""Perplexity of every weight format and KV cache type, from one run (issue: quantization).

Each configuration is a fresh engine on the same model, scored by `kvserve.eval.perplexity`
(engine prompt logprobs) on the shipped corpus (Persuasion, chapters 1-8, ~29.7k tokens):
fp32, bf16, int8, int4 and fp8 weights with the default KV cache, then fp8_e4m3 and int8 KV
caches with fp32 weights, and int4 / int8 weights with an int8 KV cache. Also prints each
loaded model's weight bytes and the KV pool's tokens for the same `--kv-cache-memory`, as
ratios to fp32.

    python benchmarks/bench_quant_perplexity.py [--max-tokens N] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import machine  # noqa: E402
from kvserve.config import EngineConfig  # noqa: E402
from kvserve.engine.llm_engine import LLMEngine  # noqa: E402
from kvserve.eval.perplexity import load_corpus, perplexity  # noqa: E402

CONFIGS = [
    ("fp32", {}),
    ("bf16", {"dtype": "bfloat16"}),
    ("int8", {"quantization": "int8"}),
    ("int4", {"quantization": "int4"}),
    ("fp8", {"quantization": "fp8"}),
    ("fp32 + fp8_e4m3 KV", {"kv_cache_dtype": "fp8_e4m3"}),
    ("fp32 + int8 KV", {"kv_cache_dtype": "int8"}),
    ("int4 + int8 KV", {"quantization": "int4", "kv_cache_dtype": "int8"}),
    ("int8 + int8 KV", {"quantization": "int8", "kv_cache_dtype": "int8"}),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-tokens", type=int, default=None, help="score only the first N corpus tokens")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--kv-cache-memory", default="512MiB")
    ap.add_argument("--only", default=None, help="comma-separated config names (default: all)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    wanted = set(args.only.split(",")) if args.only else None

    rows, ids = [], None
    for name, kw in CONFIGS:
        if wanted and name not in wanted:
            continue
        engine = LLMEngine(EngineConfig(model=args.model, kv_cache_memory=args.kv_cache_memory, **kw))
        ids = ids or load_corpus(engine, max_tokens=args.max_tokens)
        res = perplexity(engine, ids, args.window, progress=False)
        rows.append({
            "config": name, **kw, "perplexity": res.perplexity, "tokens": res.num_tokens,
            "tokens_per_s": res.tokens_per_s, "weight_bytes": engine.model_runner.model.weight_bytes(),
            "kv_pool_tokens": engine.pool_size.num_tokens,
        })  # fmt: skip
        print(f"{name:>20}: ppl {res.perplexity:.4f} ({res.num_tokens} tokens, {res.tokens_per_s:.0f} tok/s)")
        if args.json:  # after every configuration, so a long run keeps what it measured
            with open(args.json, "w") as f:
                json.dump({"machine": machine(), "window": args.window, "rows": rows}, f, indent=2)
        del engine
        gc.collect()

    base = next((r for r in rows if r["config"] == "fp32"), rows[0])
    print(f"\n{machine()}, {datetime.date.today()}, window {args.window}, {rows[0]['tokens']} tokens scored")
    print("| config | perplexity | vs fp32 | weight MiB (vs fp32) | KV pool tokens (vs fp32) | tok/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        delta = 100 * (r["perplexity"] / base["perplexity"] - 1)
        print(
            f"| {r['config']} | {r['perplexity']:.4f} | {delta:+.2f}% "
            f"| {r['weight_bytes'] / 2**20:.1f} ({r['weight_bytes'] / base['weight_bytes']:.1%}) "
            f"| {r['kv_pool_tokens']} ({r['kv_pool_tokens'] / base['kv_pool_tokens']:.2f}x) "
            f"| {r['tokens_per_s']:.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
