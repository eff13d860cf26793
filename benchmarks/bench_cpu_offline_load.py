"""Issue 16's c=32 workload through the offline engine: each weight format against fp32, per tree.

bench_cpu_serve.py measures the acceptance's form (the server, a streaming client); on a shared
2-core host its rounds spread by tens of percent (the client, the API process and the host's
neighbours all share the cores), too much to see a kernel change of 10-20%. This is the same
work without HTTP: `--requests` prompts of ~`--prompt` tokens, `--tokens` outputs each (greedy,
ignore_eos), at most 32 sequences at a time (max_num_seqs), prefill steps capped as the
configuration says (named as in bench_cpu_serve.py), prefix caching off. Every configuration
(and tree, with `--baseline-tree`) runs in its own process, in alternating order round by round;
each round's throughput is taken against the fp32 run beside it. Prints the CPU flags (run it
under `avx2_emulated.sh --native` for the AVX2-only paths).

    python benchmarks/bench_cpu_offline_load.py [--configs fp32,int4-kv8-cap64,int8-kv8-cap64]
        [--rounds 3] [--baseline-tree DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_cpu_serve import _engine_kwargs, config_flags  # noqa: E402
from benchmarks.common import run_header  # noqa: E402
from benchmarks.tree_compare import add_tree_options, answer_child, compared_trees, in_tree_child  # noqa: E402


def measure(args) -> dict:
    """In a child: output tokens/s of the workload (after a small warm-up run)."""
    from benchmarks.common import make_prompts
    from kvserve import LLM, SamplingParams

    llm = LLM(
        "smollm2-135m", kv_cache_memory="512MiB", max_num_seqs=32, enable_prefix_caching=False,
        **_engine_kwargs(config_flags(args.config)),
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate(make_prompts(llm.tokenizer, 8, args.prompt, seed=99), params, use_tqdm=False)
    prompts = make_prompts(llm.tokenizer, args.requests, args.prompt, seed=args.seed)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    return {"tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / seconds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="fp32,int4-kv8-cap64,int8-kv8-cap64")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=100)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    add_tree_options(ap)
    args = ap.parse_args()
    if answer_child(args, measure):
        return 0
    configs = args.configs.split(",")
    for c in configs:
        config_flags(c)  # a bad name fails before any run
    if "fp32" not in configs:
        ap.error("--configs: needs fp32, the yardstick")
    trees = compared_trees(ap, args)
    runs = [(c, t) for c in configs for t in trees if c != "fp32" or t == "this tree"]
    print(run_header())
    print(f"{args.requests} x ~{args.prompt}-token prompts, {args.tokens} tokens each, 32 at a time")
    print("| round | configuration | tree | out tok/s | vs fp32 |\n|---|---|---|---|---|")
    ratios: dict[tuple[str, str], list[float]] = {r: [] for r in runs}
    for rnd in range(args.rounds):
        tok_s = {}
        for config, tree in runs if rnd % 2 == 0 else list(reversed(runs)):
            argv = ["--config", config, "--requests", str(args.requests), "--prompt", str(args.prompt),
                    "--tokens", str(args.tokens), "--seed", str(rnd)]  # fmt: skip
            tok_s[(config, tree)] = in_tree_child(__file__, trees[tree], *argv)["tok_s"]
        fp32 = tok_s[("fp32", "this tree")]
        for r in runs:
            ratios[r].append(tok_s[r] / fp32)
            print(f"| {rnd + 1} | {r[0]} | {r[1]} | {tok_s[r]:.1f} | {tok_s[r] / fp32:.2f}x |", flush=True)
    print(f"medians over {args.rounds} rounds; load average {os.getloadavg()}")
    for (config, tree), rs in ratios.items():
        if config != "fp32":
            print(f"{config} ({tree}): {statistics.median(rs):.2f}x fp32 (range {min(rs):.2f}-{max(rs):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
