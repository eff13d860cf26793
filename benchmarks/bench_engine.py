"""Engine throughput against transformers `generate`, same model, same process, same run.

Workload (issue: engine core): N requests x ~P prompt tokens x O output tokens (greedy,
ignore_eos), default model, fp32. Reports output tokens/s for
  - kvserve (all requests submitted at once: continuous batching, paged KV),
  - transformers generate one request at a time (a subset, its rate does not depend on N),
  - transformers generate on static padded batches of 32,
plus single-request decode tokens/s for both and kvserve's KV waste at peak.

    python benchmarks/bench_engine.py [--num-requests 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (  # noqa: E402
    hf_generate_one_at_a_time,
    hf_generate_static_batches,
    load_hf_reference,
    machine,
    make_prompts,
)
from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.model.loader.resolve import default_model_file  # noqa: E402


def run_kvserve(llm: LLM, prompts: list[list[int]], output_len: int) -> dict:
    """Submit everything at once and step the engine, sampling KV usage after each step."""
    engine = llm.llm_engine
    kv = engine.kv_cache_manager
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"bench-{i}", p, params)
    tokens, steps = 0, 0
    peak = {"blocks": 0, "waste": 0.0}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
        steps += 1
        held = sum(len(b) for b in kv.req_to_blocks.values())
        if held >= peak["blocks"]:
            used = sum(r.num_computed_tokens for r in engine.scheduler.running)
            allocated = held * kv.block_size
            peak = {"blocks": held, "waste": (allocated - used) / allocated if allocated else 0.0}
    elapsed = time.perf_counter() - t0
    assert kv.num_free_blocks == kv.num_blocks, "leaked KV blocks"
    return {
        "output_tokens": tokens,
        "seconds": elapsed,
        "tok_per_s": tokens / elapsed,
        "steps": steps,
        "preemptions": engine.scheduler.num_preemptions_total,
        "peak_kv_blocks": peak["blocks"],
        "kv_waste_at_peak": peak["waste"],
    }


def kvserve_single_decode(llm: LLM, prompt: list[int], output_len: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    m = llm.generate([prompt], params, use_tqdm=False)[0].metrics
    return (output_len - 1) / m.decode_time


def hf_single_decode(model, prompt: list[int], output_len: int) -> float:
    _, t_all = hf_generate_one_at_a_time(model, [prompt], output_len)
    _, t_one = hf_generate_one_at_a_time(model, [prompt], 1)
    return (output_len - 1) / (t_all - t_one)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--hf-sequential", type=int, default=4, help="requests timed one at a time")
    ap.add_argument("--hf-batch", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    kw = {"max_num_batched_tokens": args.max_num_batched_tokens} if args.max_num_batched_tokens else {}
    llm = LLM("smollm2-135m", dtype="float32", kv_cache_memory="2GiB", **kw)
    prompts = make_prompts(llm.tokenizer, args.num_requests, args.prompt_len)
    llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up

    res: dict = {
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "workload": vars(args),
        "mean_prompt_tokens": sum(map(len, prompts)) / len(prompts),
    }
    res["kvserve"] = run_kvserve(llm, prompts, args.output_len)
    res["kvserve"]["single_decode_tok_per_s"] = kvserve_single_decode(llm, prompts[0], args.output_len)
    print(json.dumps(res["kvserve"], indent=1), flush=True)

    if not args.skip_hf:
        model = load_hf_reference(default_model_file())
        hf_generate_one_at_a_time(model, [prompts[0]], 4)  # warm-up
        n, s = hf_generate_one_at_a_time(model, prompts[: args.hf_sequential], args.output_len)
        res["hf_sequential"] = {"output_tokens": n, "seconds": s, "tok_per_s": n / s}
        res["hf_sequential"]["single_decode_tok_per_s"] = hf_single_decode(model, prompts[0], args.output_len)
        n, s = hf_generate_static_batches(model, prompts, args.output_len, args.hf_batch)
        res["hf_static_batch"] = {
            "batch_size": args.hf_batch,
            "output_tokens": n,
            "seconds": s,
            "tok_per_s": n / s,
        }
        k = res["kvserve"]["tok_per_s"]
        res["ratio_vs_hf_sequential"] = k / res["hf_sequential"]["tok_per_s"]
        res["ratio_vs_hf_static_batch"] = k / res["hf_static_batch"]["tok_per_s"]

    print(json.dumps(res, indent=1))
    print("\n| system | output tok/s | single-request decode tok/s |\n|---|---|---|")
    print(f"| kvserve ({args.num_requests} at once) | {res['kvserve']['tok_per_s']:.1f} | "
          f"{res['kvserve']['single_decode_tok_per_s']:.1f} |")  # fmt: skip
    if not args.skip_hf:
        print(f"| transformers, one at a time | {res['hf_sequential']['tok_per_s']:.1f} | "
              f"{res['hf_sequential']['single_decode_tok_per_s']:.1f} |")  # fmt: skip
        print(
            f"| transformers, static batch {args.hf_batch} | {res['hf_static_batch']['tok_per_s']:.1f} | - |"
        )
        print(f"\nkvserve / one-at-a-time: {res['ratio_vs_hf_sequential']:.1f}x; "
              f"kvserve / static batch {args.hf_batch}: {res['ratio_vs_hf_static_batch']:.2f}x; "
              f"KV waste at peak: {100 * res['kvserve']['kv_waste_at_peak']:.2f}%")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
