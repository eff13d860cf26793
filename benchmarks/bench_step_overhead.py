"""What a decode step costs outside the C++ decode stack (issue 16: per-step overhead), per tree.

Offline engine, default model, `--config` (make serve's int4-kv8 by default): `--batch`
prompts of ~`--prompt` tokens, greedy, `--tokens` outputs each, run `--reps` times. Every
pure-decode step is timed twice: the whole `LLMEngine.step` (schedule, metadata, the model
call, sampling, outputs, detokenization) and the stack's own C++ call inside it. The
difference is the Python around the model, and it runs cold: the step's weight stream
(~95 MB) has just pushed the interpreter's code and data out of every cache (on a Zen 4 guest
~560 us a single-stream step, against ~190 us for the same Python with the stack call replaced
by its saved logits: docs/BENCHMARKS.md, issue 16 round 26).

With `--baseline-tree DIR` (another kvserve tree, e.g. `git archive <rev> | tar -x -C DIR`)
each round also measures that tree, in alternating order, each in its own process; the
summary is this tree's median over the baseline's, per figure. Prints the CPU flags.

    python benchmarks/bench_step_overhead.py [--batch 1] [--rounds 6] [--baseline-tree DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import run_header  # noqa: E402
from benchmarks.tree_compare import add_tree_options, answer_child, compared_trees, in_tree_child  # noqa: E402

CONFIGS = {
    "int4-kv8": {"quantization": "int4", "kv_cache_dtype": "int8"},
    "int8-kv8": {"quantization": "int8", "kv_cache_dtype": "int8"},
}


class TimedStack:
    """The decode stack with its decode steps' calls timed (the model sees it as the stack
    itself). Only `forward_logits` is timed: a step of sampled rows alone (every decode step
    here); `forward` also runs steps with prompt rows laid out as decodes."""

    def __init__(self, stack, times: list[float]) -> None:
        self.stack, self.times = stack, times

    def has_head(self) -> bool:
        return self.stack.has_head()

    def forward(self, *args):
        return self.stack.forward(*args)

    def forward_logits(self, *args):
        t0 = time.perf_counter()
        out = self.stack.forward_logits(*args)
        self.times.append(time.perf_counter() - t0)
        return out


def measure(args) -> dict:
    """In a child: medians over the pure-decode steps of every rep."""
    from benchmarks.common import make_prompts
    from kvserve import LLM, SamplingParams

    llm = LLM("smollm2-135m", kv_cache_memory="256MiB", **CONFIGS[args.config])
    engine, model = llm.llm_engine, llm.llm_engine.model_runner.model
    stack_s: list[float] = []
    step_s: list[tuple[float, int]] = []  # (seconds, stack calls before it ended)
    build = model._decode_stack

    def timed_stack(*a):
        stack = build(*a)
        return None if stack is None else TimedStack(stack, stack_s)

    step = engine.step

    def timed_step():
        before, t0 = len(stack_s), time.perf_counter()
        out = step()
        step_s.append((time.perf_counter() - t0, len(stack_s) - before))
        return out

    model._decode_stack, engine.step = timed_stack, timed_step
    prompts = make_prompts(llm.tokenizer, args.batch, args.prompt, seed=1)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    steps, outside = [], []
    for _ in range(args.reps):
        stack_s.clear(), step_s.clear()
        llm.generate(prompts, params, use_tqdm=False)
        calls = iter(stack_s)
        for seconds, n in step_s:
            inner = [next(calls) for _ in range(n)]
            if n == 1:  # a decode step, the stack's one call (not a step with prompt rows)
                steps.append(seconds)
                outside.append(seconds - inner[0])
    return {
        "step_ms": statistics.median(steps) * 1e3,
        "outside_ms": statistics.median(outside) * 1e3,
        "steps": len(steps),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="int4-kv8", choices=sorted(CONFIGS))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=65)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=6)
    add_tree_options(ap)
    args = ap.parse_args()
    if answer_child(args, measure):
        return 0
    trees = compared_trees(ap, args)
    print(run_header())
    print(f"{args.config}, {args.batch} x ~{args.prompt}-token prompts, {args.tokens} tokens, "
          f"{args.reps} reps a turn")  # fmt: skip
    print("| round | tree | decode step ms | outside the stack ms |\n|---|---|---|---|")
    results: dict[str, list[dict]] = {name: [] for name in trees}
    argv = ["--config", args.config, "--batch", str(args.batch), "--prompt", str(args.prompt),
            "--tokens", str(args.tokens), "--reps", str(args.reps)]  # fmt: skip
    for rnd in range(args.rounds):
        for name in list(trees) if rnd % 2 == 0 else list(reversed(trees)):
            r = in_tree_child(__file__, trees[name], *argv)
            results[name].append(r)
            print(f"| {rnd + 1} | {name} | {r['step_ms']:.3f} | {r['outside_ms']:.3f} |", flush=True)
    keys = ("step_ms", "outside_ms")
    med = {n: {k: statistics.median(r[k] for r in rs) for k in keys} for n, rs in results.items()}
    for name, m in med.items():
        print(f"{name}: median decode step {m['step_ms']:.3f} ms, outside the stack {m['outside_ms']:.3f} ms")
    if "baseline" in med:
        b, t = med["baseline"], med["this tree"]
        print(f"this tree / baseline: step {t['step_ms'] / b['step_ms']:.3f}x, "
              f"outside the stack {t['outside_ms'] / b['outside_ms']:.3f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
