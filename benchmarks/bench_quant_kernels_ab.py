"""This tree's native quantized matmuls against another tree's, alternating in one process (issue 16).

bench_decode_stack_ab.py's method for the other extension: one offline engine (default model,
`--config`) holds two C++ decode stacks over the same weights and KV cache. Both are this
tree's stack code; one calls the matmuls of this tree's quant kernels module
(csrc/quant_matmul_cpu.cpp, the variant this CPU selects), the other the same variant built
from `--baseline-tree`'s source (its own module name: the name hashes the source). Each round
decodes `--batch` prompts (one of ~128 tokens; or ~16 tokens each, like
bench_decode_roofline.py's batched step) with each stack in turn, order alternating: time per
decode step, (n+1)-token run minus 1-token run over n, the runs seconds apart. Prompt steps run
this tree's kernels in both. Prints each round's ratio (this tree over the baseline), their
median and the CPU flags; the two stacks' greedy tokens must agree.

    python benchmarks/bench_quant_kernels_ab.py --baseline-tree DIR [--batch 64] [--rounds 16]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_decode_roofline import decode_s  # noqa: E402
from benchmarks.bench_decode_stack_ab import CONFIGS, alternate  # noqa: E402
from benchmarks.common import make_prompts, run_header  # noqa: E402
from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.model.layers import quant_kernels  # noqa: E402
from kvserve.model.layers.cpu_kernels import build_extension  # noqa: E402


def baseline_module(tree: str, variant: str):
    """`variant` of the quant kernels as `tree`'s source builds it, with this tree's flags."""
    src = os.path.join(tree, "kvserve", "csrc", "quant_matmul_cpu.cpp")
    with open(src, "rb") as f:
        name = quant_kernels.build_name(variant, f.read())
    return build_extension(name, [src], quant_kernels.VARIANTS[variant])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline-tree", required=True, help="another kvserve tree")
    ap.add_argument("--config", default="int4-kv8", choices=sorted(CONFIGS))
    ap.add_argument("--batch", type=int, default=1, help="prompts decoded together")
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=None, help="decode steps a run (64 at one row, else 24)")
    args = ap.parse_args()
    tokens = args.tokens or (64 if args.batch == 1 else 24)
    print(run_header())

    variant = quant_kernels.selected_variant()
    llm = LLM("smollm2-135m", kv_cache_memory="256MiB", **CONFIGS[args.config])
    model = llm.llm_engine.model_runner.model
    prompts = make_prompts(llm.tokenizer, args.batch, 128 if args.batch == 1 else 16, seed=1)

    def greedy(n: int) -> list[list[int]]:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    greedy(4)  # builds this tree's stack (model._stack: its key and the stack)
    key, ours = model._stack
    own = quant_kernels.load_quant_kernels(variant)
    quant_kernels._modules[variant] = baseline_module(args.baseline_tree, variant)
    try:
        theirs = model._build_decode_stack()
    finally:
        quant_kernels._modules[variant] = own
    decoded = []
    for stack in (ours, theirs):
        model._stack = (key, stack)
        decoded.append(greedy(tokens + 1))
    if decoded[0] != decoded[1]:
        sys.exit("the two trees' kernels decoded different greedy tokens")
    print(f"{args.config} ({variant}), {args.batch} prompt(s), {tokens} decode steps a run; ms per step")
    alternate(model, key, ours, theirs, lambda: decode_s(llm, prompts, tokens) * 1e3, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
