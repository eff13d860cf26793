"""The C++ decode stack (csrc/decode_stack_cpu.cpp) against the Python layer loop it replaces.

The stack runs the same kernels in the same order, so greedy tokens and their logprobs must be
identical, not close: the Python fused path is itself tested against the torch path and
transformers (test_cpu_layer_ops.py, test_fidelity.py).
"""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.model.layers.cpu_kernels import load_cpu_kernels
from kvserve.model.layers.quant_kernels import load_quant_kernels

pytestmark = pytest.mark.skipif(
    load_cpu_kernels() is None or load_quant_kernels() is None, reason="C++ kernels not built here"
)

# 19 prompts: the decode batch pads to 20 rows (shape_buckets), so padding rows go through it.
PROMPTS = [[5 + i, 9, 17 + 2 * i, 33, 2 + i % 7, 41] for i in range(19)] + [[11, 3, 8]]


def _both_paths(llm: LLM, prompts: list[list[int]]) -> tuple[list, list, object]:
    model = llm.llm_engine.model_runner.model
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    stacked = llm.generate(prompts, params, use_tqdm=False)
    stack = model._stack[1] if model._stack else None
    model.use_decode_stack = False
    try:
        plain = llm.generate(prompts, params, use_tqdm=False)
    finally:
        model.use_decode_stack = True
    return stacked, plain, stack


def _assert_identical(stacked: list, plain: list) -> None:
    for a, b in zip(stacked, plain, strict=True):
        ca, cb = a.outputs[0], b.outputs[0]
        assert ca.token_ids == cb.token_ids
        assert ca.logprobs == cb.logprobs  # every float equal: the same arithmetic


@pytest.mark.parametrize(
    ("quantization", "kv_cache_dtype"), [("int4", "auto"), ("int8", "auto"), ("int4", "int8")]
)
def test_stack_equals_the_python_layers(tiny_llama_dir, quantization, kv_cache_dtype):
    llm = LLM(
        tiny_llama_dir, kv_cache_memory="16MiB", quantization=quantization, kv_cache_dtype=kv_cache_dtype
    )
    stacked, plain, stack = _both_paths(llm, PROMPTS)
    assert stack is not None  # the stack ran the decode steps
    _assert_identical(stacked, plain)


@pytest.mark.parametrize(
    ("fixture", "kwargs"), [("tiny_llama_dir", {}), ("tiny_qwen2_dir", {"quantization": "int4"})]
)
def test_layers_it_cannot_take_stay_in_python(request, fixture, kwargs):
    """Float projections (oneDNN) and biased ones (Qwen2's qkv) keep the Python loop."""
    llm = LLM(request.getfixturevalue(fixture), kv_cache_memory="16MiB", **kwargs)
    stacked, plain, stack = _both_paths(llm, PROMPTS[:3])
    assert stack is None
    _assert_identical(stacked, plain)
