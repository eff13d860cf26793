"""A single stream's decode stack with its weights from memory against the same stack with
them hot in cache (issue 16: whether the weight stream overlaps the layers' other work).

A token reads every weight once. If the layers' serial work (attention, the small ops, the
kernels' dispatch) ran while the weights streamed in, the stack would take about the larger
of the two; if not, their sum. This captures one real decode step's stack call (default
model, int4 weights, one ~`--context`-token sequence) and replays it two ways in one process,
alternating: as built (each layer its own weights, which come from memory: 63 MiB pass
through a cache far smaller), and with layer 0's weights in all the layers (the same shapes,
the same KV cache and attention, the weights hot in cache). It prints both, their
difference, and the time the layers' weights take to stream at the read bandwidth measured
in the same run. Where the stack has its overlapped path (csrc/decode_overlap_cpu.cpp: one
parallel region, the other threads loading the next weights during the serial work), both
are also run without it (one parallel region per kernel), alternating with the rest.

    python benchmarks/bench_decode_stack_hot.py [--kv-cache-dtype auto|int8] [--rounds 30]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_decode_roofline import read_bandwidth  # noqa: E402
from benchmarks.common import machine, make_prompts  # noqa: E402
from benchmarks.cpu_info import cpu_flags  # noqa: E402
from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.model.models.llama import OVERLAP_MAX_ROWS, add_stack_layer  # noqa: E402


def captured_stack_call(llm: LLM, context: int) -> tuple[object, list]:
    """The model and the arguments of one decode step's DecodeStack.forward."""
    model = llm.llm_engine.model_runner.model
    seen: list = []
    build = model._decode_stack

    def capture(*a):
        stack = build(*a)
        if stack is None:
            return None

        class Recorder:
            def has_head(self) -> bool:  # decode_logits then calls forward and the lm_head apart
                return False

            def forward(self, *args):
                seen[:] = [t.clone() if i == 0 else t for i, t in enumerate(args)]  # x is added into
                return stack.forward(*args)

        return Recorder()

    model._decode_stack = capture
    try:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        llm.generate(make_prompts(llm.tokenizer, 1, context), params, use_tqdm=False)
    finally:
        del model._decode_stack  # the class's method again
    if not seen:
        raise SystemExit("no decode step went through the C++ decode stack here")
    return model, seen


def hot_stack(model):
    """A DecodeStack whose every layer holds layer 0's norms and projections (its own KV scales)."""
    first = model.layers[0]
    stack = model.ops.DecodeStack(first.num_heads, first.num_kv_heads, first.head_dim, first.eps)
    calls = [p.quant.native_matmul() for p in first.projections().values()]
    biases = [p.bias for p in first.projections().values()]
    for layer in model.layers:
        add_stack_layer(stack, first.input_norm, first.post_attn_norm, calls, biases, layer.attn.kv_scales)
    stack.set_overlap_rows(OVERLAP_MAX_ROWS)
    return stack


def layer_weight_bytes(model) -> int:
    """Bytes of the layers' projections and norms, each read once a token."""
    total = 0
    for layer in model.layers:
        for p in layer.projections().values():
            call = p.quant.native_matmul()
            total += call.codes.nbytes + call.scales.nbytes
        total += layer.input_norm.nbytes + layer.post_attn_norm.nbytes
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--context", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{machine()}; CPU flags: {cpu_flags()}; {now}; load average {os.getloadavg()}")
    llm = LLM("smollm2-135m", quantization="int4", kv_cache_dtype=args.kv_cache_dtype)
    model, call = captured_stack_call(llm, args.context)
    stacks = {"from memory": model._build_decode_stack(), "hot": hot_stack(model)}
    if stacks["from memory"] is None:
        raise SystemExit("the decode stack does not take this model here")
    if stacks["from memory"].overlap_usable():  # and as it ran before it (one region per kernel)
        stacks["from memory, no overlap"] = model._build_decode_stack()
        stacks["from memory, no overlap"].set_overlap_rows(0)
        stacks["hot, no overlap"] = hot_stack(model)
        stacks["hot, no overlap"].set_overlap_rows(0)

    def run(stack) -> float:
        inputs = [call[0].clone(), *call[1:]]
        t0 = time.perf_counter()
        stack.forward(*inputs)
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {name: [] for name in stacks}
    with torch.inference_mode():
        for stack in stacks.values():
            for _ in range(10):
                run(stack)
        for _ in range(args.rounds):  # alternating, best of 3 each turn: drift falls on both
            for name, stack in stacks.items():
                times[name].append(min(run(stack) for _ in range(3)))
    bandwidth = read_bandwidth()
    weight_bytes = layer_weight_bytes(model)
    mib, stream_ms = weight_bytes / 2**20, weight_bytes / bandwidth * 1e3
    best = {name: min(t) * 1e3 for name, t in times.items()}
    for name, t in times.items():
        print(f"stack {name}: best {best[name]:.2f} ms, median {statistics.median(t) * 1e3:.2f} ms")
    overlap = max(best["hot"], stream_ms)
    print(f"difference {best['from memory'] - best['hot']:.2f} ms; the layers' {mib:.1f} MiB stream in "
          f"{stream_ms:.2f} ms at {bandwidth / 1e9:.1f} GB/s")  # fmt: skip
    print(f"full overlap would take the stack to about max(hot, stream) = {overlap:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
