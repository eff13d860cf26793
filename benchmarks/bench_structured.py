"""Structured-output throughput: 32 concurrent JSON-schema requests against 32 unconstrained
requests of the same lengths, same engine, same run (issue: structured outputs, >= 85%).

The constrained requests run first (varied schemas, each compiled on arrival); each one's
output length is then given to an unconstrained twin (same prompt, ignore_eos, max_tokens =
that length), so both sides decode exactly the same number of tokens. Then `--rounds`
rounds alternate unconstrained and constrained (compile cache warm), so a load change on a
shared machine hits both sides alike. Reported: output tokens/s of each side, the cold
ratio (compiling included) and the warm ratio over all rounds. The prefix cache is reset
before every pass, so each pass pays for its prompts' prefill alike.

    python benchmarks/bench_structured.py [--num-requests 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import machine  # noqa: E402
from kvserve import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from kvserve.bench.json_schemas import varied_schemas  # noqa: E402


def timed(llm: LLM, prompts: list, params: list[SamplingParams]) -> tuple[list[int], float]:
    # Every pass prefills its prompts: without this, passes after the first would find them
    # in the prefix cache and skip the prefill the first (cold) pass paid for.
    llm.llm_engine.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [len(o.outputs[0].token_ids) for o in outs], time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    llm = LLM("smollm2-135m")
    tok = llm.tokenizer
    schemas = varied_schemas(args.num_requests, args.seed)
    prompts = [
        tok.encode(
            tok.apply_chat_template(
                [{"role": "user", "content": f"A JSON object with {', '.join(s['properties'])}."}]
            ),
            add_special_tokens=False,
        )
        for s in schemas
    ]
    warm = SamplingParams(
        temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[a-z]+")
    )
    llm.generate(prompts[:2], [warm, SamplingParams(max_tokens=8)], use_tqdm=False)  # load kernels, xgrammar

    def constrained() -> list[SamplingParams]:
        return [
            SamplingParams(temperature=0.7, seed=i, max_tokens=args.max_tokens,
                           structured_outputs=StructuredOutputsParams(json=s))
            for i, s in enumerate(schemas)
        ]  # fmt: skip

    lens, t_cold = timed(llm, prompts, constrained())
    twins = [
        SamplingParams(temperature=0.7, seed=i, max_tokens=n, ignore_eos=True) for i, n in enumerate(lens)
    ]
    t_plain, t_warm, rounds = 0.0, 0.0, []
    for _ in range(args.rounds):
        plain_lens, tp = timed(llm, prompts, twins)
        warm_lens, tw = timed(llm, prompts, constrained())
        assert plain_lens == lens and warm_lens == lens, "outputs of the same seeds differ in length"
        t_plain, t_warm = t_plain + tp, t_warm + tw
        rounds.append(round(tp / tw, 3))
    tokens = sum(lens)
    res = {
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "num_requests": args.num_requests,
        "output_tokens_per_side": tokens,
        "unconstrained_tok_s": tokens * args.rounds / t_plain,
        "json_schema_cold_tok_s": tokens / t_cold,
        "json_schema_warm_tok_s": tokens * args.rounds / t_warm,
        "ratio_cold": (t_plain / args.rounds) / t_cold,
        "ratio_warm": t_plain / t_warm,
        "ratio_warm_per_round": rounds,
    }
    for k, v in res.items():
        print(f"{k:>24}: {v:.3f}" if isinstance(v, float) else f"{k:>24}: {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
