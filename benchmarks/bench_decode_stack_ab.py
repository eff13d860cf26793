"""This tree's C++ decode stack against another tree's, alternating in one process (issue 16).

A shared host's speed drifts by tens of percent within minutes, so two processes measured in
turn (bench_step_overhead.py with --baseline-tree) can differ by more than a kernel change
does: the same code in both trees there read 0.94x over 8 rounds. Here one offline engine
(default model, `--config`) holds two decode stacks over the same weights and KV cache: its own,
built by this tree's CPU kernels extension, and one built by `--baseline-tree`'s (its
csrc/ compiled under that tree's module name; the native matmuls both call are this tree's).
Each round decodes one ~`--prompt`-token prompt with each stack in turn (order alternating): the
decode time per token, (n+1)-token run minus 1-token run over n, the runs seconds apart. With
`--batch N` each run decodes N prompts of ~`--prompt` tokens together (the time per step). It
prints each round's ratio (this tree over the baseline) and their median. Prints the CPU
flags.

    python benchmarks/bench_decode_stack_ab.py --baseline-tree DIR [--config int4-kv8] [--rounds 20]
        [--prompt 128]  (the prompt's length in tokens: the context attention reads) [--batch 1]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import types
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_decode_roofline import decode_s  # noqa: E402
from benchmarks.common import make_prompts, run_header  # noqa: E402
from kvserve import LLM  # noqa: E402

CONFIGS = {
    "int4-kv8": {"quantization": "int4", "kv_cache_dtype": "int8"},
    "int4": {"quantization": "int4"},
    "int8-kv8": {"quantization": "int8", "kv_cache_dtype": "int8"},
}


def baseline_kernels(tree: str):
    """The CPU kernels extension as `tree`'s sources build it (its own loader, its own name)."""
    path = os.path.join(tree, "kvserve", "model", "layers", "cpu_kernels.py")
    spec = importlib.util.spec_from_file_location("baseline_cpu_kernels", path)
    loader = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loader)
    ops = loader.load_cpu_kernels()
    if ops is None:
        sys.exit(f"the baseline tree's CPU kernels did not build ({path})")
    if hasattr(ops.DecodeStack, "set_split_rows"):
        return ops
    return types.SimpleNamespace(**{**vars(ops), "DecodeStack": _without_split(ops.DecodeStack)})


def _without_split(stack_class):
    """A tree's DecodeStack from before round 30, which has no split mode: set_split_rows (which
    this tree's llama.py calls) is a no-op on it."""

    class DecodeStack(stack_class):
        def set_split_rows(self, rows: int) -> None:
            pass

    return DecodeStack


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline-tree", required=True, help="another kvserve tree (see the docstring)")
    ap.add_argument("--config", default="int4-kv8", choices=sorted(CONFIGS))
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=32, help="decode steps timed per run")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens (the context attention reads)")
    ap.add_argument("--batch", type=int, default=1, help="prompts decoded together")
    args = ap.parse_args()
    print(run_header())

    llm = LLM("smollm2-135m", kv_cache_memory="256MiB", max_model_len=8192, **CONFIGS[args.config])
    model = llm.llm_engine.model_runner.model
    prompt = make_prompts(llm.tokenizer, args.batch, args.prompt, seed=1)

    decode_s(llm, prompt, 3)  # builds this tree's stack (model._stack: its key and the stack)
    key, ours = model._stack
    own_ops, model.ops = model.ops, baseline_kernels(args.baseline_tree)
    try:
        theirs = model._build_decode_stack()
    finally:
        model.ops = own_ops
    runs = f"{args.batch} prompt(s) of ~{args.prompt} tokens, {args.tokens} decode steps a run"
    print(f"{args.config}, {runs}; ms per step")
    alternate(model, key, ours, theirs, lambda: decode_s(llm, prompt, args.tokens) * 1e3, args.rounds)
    return 0


def alternate(model, key: int, ours, theirs, step_ms: Callable[[], float], rounds: int) -> None:
    """Time `step_ms` with the model on each decode stack in turn, order alternating by round;
    print each round's ratio (this tree's over the baseline's) and their median. Leaves the
    model on `ours`."""
    stacks = {"this tree": ours, "baseline": theirs}
    print("| round | this tree | baseline | ratio |\n|---|---|---|---|")
    ratios = []
    for rnd in range(rounds):
        ms = {}
        for name in list(stacks) if rnd % 2 == 0 else list(reversed(stacks)):
            model._stack = (key, stacks[name])
            ms[name] = step_ms()
        ratios.append(ms["this tree"] / ms["baseline"])
        print(f"| {rnd + 1} | {ms['this tree']:.3f} | {ms['baseline']:.3f} | {ratios[-1]:.3f} |", flush=True)
    model._stack = (key, ours)
    below = sum(r < 1 for r in ratios)
    print(f"this tree / baseline: median {statistics.median(ratios):.3f}x "
          f"(range {min(ratios):.3f}-{max(ratios):.3f}; below 1 in {below} of {len(ratios)} rounds); "
          f"load average {os.getloadavg()}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
