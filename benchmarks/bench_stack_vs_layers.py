"""The C++ decode stack against the Python layer loop it replaces, one offline engine (issue 16).

Round 40 let the stack take configurations that kept the Python layers before (an fp8 KV
cache, biased projections, a draft model beside it). Both paths compute the same bits
(tests/test_decode_stack.py); this measures what the stack saves there. One engine on the
default model (`--config`), one ~`--prompt`-token prompt, greedy: the decode time per token,
(n+1)-token run minus 1-token run over n, with `use_decode_stack` on and off in turn (order
alternating each round), the runs seconds apart. Prints each round's ratio (stack over Python
layers), their median and the CPU flags.

    python benchmarks/bench_stack_vs_layers.py [--config int4-fp8] [--rounds 10] [--prompt 128]
        [--tokens 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import make_prompts, run_header  # noqa: E402
from kvserve import LLM, SamplingParams  # noqa: E402

CONFIGS = {
    "int4-fp8": {"quantization": "int4", "kv_cache_dtype": "fp8_e4m3"},
    "int8-fp8": {"quantization": "int8", "kv_cache_dtype": "fp8_e4m3"},
    "int4-kv8": {"quantization": "int4", "kv_cache_dtype": "int8"},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=sorted(CONFIGS), default="int4-fp8")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--prompt", type=int, default=128, help="the prompt's length in tokens")
    ap.add_argument("--tokens", type=int, default=64, help="decoded tokens a timed run")
    args = ap.parse_args()
    print(run_header())
    llm = LLM("smollm2-135m", kv_cache_memory="256MiB", **CONFIGS[args.config])
    model = llm.llm_engine.model_runner.model
    prompt = make_prompts(llm.tokenizer, 1, args.prompt, jitter=0)

    def run(n: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t = time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False)
        return time.perf_counter() - t

    def per_token(stack: bool) -> float:
        model.use_decode_stack = stack
        return (run(args.tokens + 1) - run(1)) / args.tokens

    per_token(True), per_token(False)  # warm both paths
    if model._stack is None:
        raise SystemExit(f"{args.config}: the decode stack does not run this configuration here")
    ratios = []
    for r in range(args.rounds):
        order = (True, False) if r % 2 == 0 else (False, True)
        t = {stack: per_token(stack) for stack in order}
        ratios.append(t[True] / t[False])
        print(f"round {r}: stack {t[True] * 1e3:.2f} ms/token, Python layers {t[False] * 1e3:.2f}, "
              f"ratio {ratios[-1]:.3f}")  # fmt: skip
    model.use_decode_stack = True
    print(f"{args.config}: stack / Python layers, median of {args.rounds}: {statistics.median(ratios):.3f} "
          f"(range {min(ratios):.3f}-{max(ratios):.3f})")  # fmt: skip


if __name__ == "__main__":
    main()
