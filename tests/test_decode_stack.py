"""The C++ decode stack (csrc/decode_stack_cpu.cpp) against the Python layer loop it replaces.

The stack runs the same kernels in the same order, so greedy tokens and their logprobs must be
identical, not close: the Python fused path is itself tested against the torch path and
transformers (test_cpu_layer_ops.py, test_fidelity.py).
"""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model.layers.cpu_kernels import load_cpu_kernels
from kvserve.model.layers.quant_kernels import load_quant_kernels

pytestmark = pytest.mark.skipif(
    load_cpu_kernels() is None or load_quant_kernels() is None, reason="C++ kernels not built here"
)

# 20 prompts; 19 of them make a decode batch padded to 20 rows (shape_buckets): a padding row.
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


@pytest.fixture
def torch_threads():
    """Sets torch's thread count for one test (restored after it)."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _assert_identical(stacked: list, plain: list) -> None:
    for a, b in zip(stacked, plain, strict=True):
        ca, cb = a.outputs[0], b.outputs[0]
        assert ca.token_ids == cb.token_ids
        assert ca.logprobs == cb.logprobs  # every float equal: the same arithmetic


@pytest.mark.parametrize(
    ("quantization", "kv_cache_dtype"),
    [("int4", "auto"), ("int8", "auto"), ("int4", "int8"), ("int8", "fp8_e4m3")],
)
def test_stack_equals_the_python_layers(tiny_llama_dir, quantization, kv_cache_dtype, torch_threads):
    torch_threads(2)
    llm = LLM(
        tiny_llama_dir, kv_cache_memory="16MiB", quantization=quantization, kv_cache_dtype=kv_cache_dtype
    )
    stacked, plain, stack = _both_paths(llm, PROMPTS[1:])
    assert stack is not None and stack.has_head()  # the stack ran the decode steps, logits included
    _assert_identical(stacked, plain)
    # its 11 decode steps of 19 rows padded to 20 ran overlapped (and split), the padding row too
    assert stack.overlapped_steps() == 11


def test_float_projections_stay_in_python(tiny_llama_dir):
    """Float projections (oneDNN) keep the Python loop."""
    llm = LLM(tiny_llama_dir, kv_cache_memory="16MiB")
    stacked, plain, stack = _both_paths(llm, PROMPTS[:3])
    assert stack is None
    _assert_identical(stacked, plain)


@pytest.mark.parametrize(
    ("kind", "quantization", "kv_cache_dtype"), [("qwen2", "int4", "int8"), ("llama", "int8", "auto")]
)
def test_biased_projections_run_in_the_stack_with_the_same_bits(
    tiny_biased_dirs, kind, quantization, kv_cache_dtype, torch_threads
):
    """Biased projections (Qwen2's qkv; Llama's attention_bias and mlp_bias) run in the stack,
    each bias added where Python adds it, on all three of its paths: the per-kernel loop (one
    thread), the overlapped region (one row) and its split by rows (19 rows). Until round 40
    they kept the Python loop, and with it SDPA for prompt chunks: greedy results of quantized
    Qwen2 moved with batching and preemption."""
    engine = dict(quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    llm = LLM(tiny_biased_dirs[kind], kv_cache_memory="16MiB", **engine)
    for threads, prompts in [(1, PROMPTS[:2]), (2, PROMPTS[:1]), (2, PROMPTS[1:])]:
        torch_threads(threads)
        stacked, plain, stack = _both_paths(llm, prompts)
        assert stack is not None and stack.has_head()
        _assert_identical(stacked, plain)
    assert stack.overlap_usable() and stack.overlapped_steps() == 12 + 11  # one row, then 19 (split)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize(
    ("quantization", "kv_cache_dtype"), [("int4", "auto"), ("int8", "int8"), ("int4", "fp8_e4m3")]
)
def test_overlapped_stack_equals_the_python_layers(tiny_llama_dir, quantization, kv_cache_dtype, threads):
    """Steps of up to OVERLAP_MAX_ROWS rows (one and two here) run the whole stack in one
    parallel region (thread 0 the serial work, the others loading their share of the next
    projections and sharing the attention, the split learnt step by step per row count): the
    same bits as the Python loop, whatever the split and thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        llm = LLM(
            tiny_llama_dir, kv_cache_memory="16MiB", quantization=quantization, kv_cache_dtype=kv_cache_dtype
        )
        stacked, plain, stack = _both_paths(llm, PROMPTS[:1])
        _assert_identical(stacked, plain)
        assert stack.overlap_usable() and stack.head_overlapped()  # the lm_head the region's last stage
        # every step: the 6-token prompt as 6 decode rows (a short chunk runs as decodes), then
        # the 11 decodes of one row
        assert stack.overlapped_steps() == 12
        stacked, plain, _ = _both_paths(llm, PROMPTS[1:3])  # 12 prompt rows, then 11 steps of 2
        _assert_identical(stacked, plain)
        assert stack.overlapped_steps() == 24
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_hd64_dir(tmp_path_factory) -> str:
    """Four KV heads of 64 dims, two query heads each: the vectorized attention loops' head size,
    and work items enough for the overlapped stack's threads to share."""
    from conftest import _save_tiny

    path = str(tmp_path_factory.mktemp("tiny-hd64"))
    shape = dict(hidden_size=512, intermediate_size=256, num_attention_heads=8)
    return _save_tiny(path, "llama", num_kv_heads=4, **shape)


def _hd64_int4(path: str, kv_cache_dtype: str) -> LLM:
    """int4 weights, both paths prefilling whole prompts (no prefix cache): the same first
    token's bits."""
    return LLM(
        path,
        kv_cache_memory="16MiB",
        quantization="int4",
        kv_cache_dtype=kv_cache_dtype,
        enable_prefix_caching=False,
    )


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_overlapped_stack_shares_attention_with_the_same_bits(
    tiny_hd64_dir, kv_cache_dtype, threads, torch_threads
):
    """The overlapped stack's workers take a layer's attention items (sequence, KV head) from
    the back while thread 0 takes them from the front: with ~300-token contexts they get some,
    and the tokens and logprobs are the Python loop's, bit for bit. Whether a worker gets there
    before thread 0 is the OS scheduler's call (on a loaded host the workers may not run at
    all for a whole step), so the prompts go again, up to four rounds, until one did."""
    torch_threads(threads)
    llm = _hd64_int4(tiny_hd64_dir, kv_cache_dtype)
    prompts = [[(7 * i + 3 * k) % 500 + 5 for i in range(280 + 9 * k)] for k in range(2)]
    for rounds in range(1, 5):
        for prompt in prompts:
            stacked, plain, stack = _both_paths(llm, [prompt])
            _assert_identical(stacked, plain)
        assert stack.overlapped_steps() == 22 * rounds
        if stack.overlapped_helped_items() > 0:
            break
    assert stack.overlapped_helped_items() > 0


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_overlapped_stack_split_by_rows_has_the_same_bits(
    tiny_hd64_dir, kv_cache_dtype, threads, torch_threads, monkeypatch
):
    """From SPLIT_ROWS rows up every thread of the overlapped stack runs the serial work (norms,
    rotary, KV writes, activation quantization) for its own rows: with 5 rows on 2 and 3 threads
    (uneven shares) the tokens and logprobs are the Python loop's, bit for bit."""
    from kvserve.model.models import llama

    monkeypatch.setattr(llama, "SPLIT_ROWS", 2)
    torch_threads(threads)
    llm = _hd64_int4(tiny_hd64_dir, kv_cache_dtype)
    prompts = [[(11 * i + 5 * k) % 500 + 5 for i in range(40 + 3 * k)] for k in range(5)]
    stacked, plain, stack = _both_paths(llm, prompts)
    _assert_identical(stacked, plain)
    assert stack.overlapped_steps() == 11  # every decode step of the 5 rows
    assert stack.overlapped_helped_items() > 0


def test_bad_input_to_the_overlapped_stack_is_raised(tiny_llama_dir):
    """Input the overlapped stack's raw kernels cannot take (here int32 block tables) is refused
    with an exception before its parallel region starts, and the stack still works after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llm = LLM(tiny_llama_dir, kv_cache_memory="16MiB", quantization="int4")
        model = llm.llm_engine.model_runner.model
        calls: list[list] = []
        build = model._decode_stack

        class Recorder:
            def __init__(self, stack):
                self.stack = stack

            def has_head(self):
                return self.stack.has_head()

            def forward_logits(self, *args):
                calls.append([args[0].clone(), *args[1:]])
                return self.stack.forward_logits(*args)

            def forward(self, *args):  # the prompt: its rows as decode rows, hidden states out
                return self.stack.forward(*args)

        def capture(*a):
            stack = build(*a)
            return None if stack is None else Recorder(stack)

        model._decode_stack = capture
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        llm.generate(PROMPTS[:1], params, use_tqdm=False)
        del model._decode_stack
        stack = model._stack[1]
        x, cos, sin, kv_cache, slot_blocks, slot_offsets, tables, lens, scale = calls[-1]
        kv = (kv_cache, slot_blocks, slot_offsets)
        with pytest.raises(RuntimeError, match="int64 block tables"):
            stack.forward_logits(x.clone(), cos, sin, *kv, tables.int(), lens, scale)
        again = stack.forward_logits(x.clone(), cos, sin, *kv, tables, lens, scale)
        assert again.shape == (1, model.arch.vocab_size) and torch.isfinite(again).all()
        # the prompt's rows, the two decode steps and the call after the error
        assert stack.overlapped_steps() == 4
    finally:
        torch.set_num_threads(before)
