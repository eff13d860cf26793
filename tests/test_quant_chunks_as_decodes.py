"""Prompt chunks as decode rows (attention_backends/cpu.py, ModelRunner._stack_takes_chunks).

Where the C++ decode stack runs a quantized model, every prompt chunk reaches it as decode
rows: each prompt token one row, attending through the paged decode kernel to its own causal
length, after the step's K/V are written. The reference is the path the same engine takes with
the switch off: torch's SDPA over the gathered cache, the attention test_fidelity.py holds to
transformers. And since every row's arithmetic is then the same however its request was
chunked, batched or preempted, a greedy request's tokens and logprobs are the same bits alone
or under load.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_quantized_match

from kvserve import LLM, SamplingParams
from kvserve.attention_backends.base import ScheduledSeq
from kvserve.attention_backends.cpu import CpuAttentionBackend
from kvserve.model.layers.cpu_kernels import load_cpu_kernels
from kvserve.model.layers.quant_kernels import load_quant_kernels


def _step() -> tuple[list[ScheduledSeq], np.ndarray]:
    """One decode (position 10), a fresh 5-token prompt and a 3-token chunk after 6 cached."""
    seqs = [
        ScheduledSeq(10, 1, [3, 5, 7], True),
        ScheduledSeq(0, 5, [1, 2], False),
        ScheduledSeq(6, 3, [4, 6, 8], False),
    ]
    return seqs, np.array([10, 0, 1, 2, 3, 4, 6, 7, 8])


def test_prompt_chunks_become_decode_rows_at_their_causal_lengths():
    backend = CpuAttentionBackend(torch.device("cpu"), block_size=4)
    seqs, positions = _step()
    backend.prompt_rows_as_decodes = True
    meta = backend.build_metadata(seqs, positions)
    assert meta.num_decodes == 9 and not meta.prefills
    assert meta.decode_seq_lens.tolist() == [11, 1, 2, 3, 4, 5, 7, 8, 9]
    assert meta.decode_block_tables.tolist() == [[3, 5, 7]] + [[1, 2, 0]] * 5 + [[4, 6, 8]] * 3
    assert meta.slot_blocks.tolist() == [7, 1, 1, 1, 1, 2, 6, 6, 8]
    assert meta.slot_offsets.tolist() == [2, 0, 1, 2, 3, 0, 2, 3, 0]


def test_without_the_stack_prompt_chunks_stay_sdpa_chunks():
    backend = CpuAttentionBackend(torch.device("cpu"), block_size=4)
    assert not backend.prompt_rows_as_decodes  # the default: the model runner turns it on
    meta = backend.build_metadata(*_step())
    assert meta.num_decodes == 1 and meta.decode_seq_lens.tolist() == [11]
    assert [(c.start, c.end, c.num_cached) for c in meta.prefills] == [(1, 6, 0), (6, 9, 6)]


def test_a_decode_step_gets_the_metadata_the_general_path_builds():
    """build_metadata's pure-decode path (one token a sequence, no numpy arrays) against the
    general one on the same step: every tensor equal, dtype and contiguity too (the kernels
    read raw pointers)."""
    backend = CpuAttentionBackend(torch.device("cpu"), block_size=4)
    seqs = [ScheduledSeq(10, 1, [3, 5, 7], True), ScheduledSeq(3, 1, [9], True)]
    seqs.append(ScheduledSeq(4, 1, [2, 8], True))
    positions = np.array([10, 3, 4])
    fast, general = backend.build_metadata(seqs, positions), backend._metadata(seqs, positions)
    assert fast.num_decodes == general.num_decodes == 3 and not fast.prefills
    for name in ("slot_blocks", "slot_offsets", "decode_block_tables", "decode_seq_lens"):
        a, b = getattr(fast, name), getattr(general, name)
        assert a.dtype == b.dtype == torch.int64 and a.is_contiguous() and torch.equal(a, b), name
    assert fast.slot_blocks.tolist() == [7, 9, 8] and fast.decode_block_tables.tolist()[1] == [9, 0, 0]


needs_kernels = pytest.mark.skipif(
    load_cpu_kernels() is None or load_quant_kernels() is None, reason="C++ kernels not built here"
)

# Prompts sharing a 36-token prefix, prefilled in chunks of 8 beside each other's decodes. A
# request for prompt logprobs computes every position; run again without them, the prompts
# start from the prefix's two cached blocks.
PREFIX = [(7 * j + 3) % 50 + 2 for j in range(36)]
PROMPTS = [PREFIX + [40 + i, 12 + i, 3 * i + 1, 25] * (1 + i % 3) for i in range(6)]


def _run(llm: LLM, as_decodes: bool) -> tuple[list, list[tuple[bool, bool]]]:
    """Outputs with prompt rows as decode rows or not; per step, whether it had prompt rows
    and whether they were laid out as prefill chunks."""
    runner = llm.llm_engine.model_runner
    backend = runner.attn_backend
    build, seen = backend.build_metadata, []

    def recording(seqs, positions):
        meta = build(seqs, positions)
        seen.append((any(not s.is_decode for s in seqs), bool(meta.prefills)))
        return meta

    backend.build_metadata, backend.prompt_rows_as_decodes = recording, as_decodes
    try:
        llm.llm_engine.reset_prefix_cache()
        params = dict(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
        fresh = llm.generate(PROMPTS, SamplingParams(**params, prompt_logprobs=1), use_tqdm=False)
        return fresh + llm.generate(PROMPTS, SamplingParams(**params), use_tqdm=False), seen
    finally:
        del backend.build_metadata
        backend.prompt_rows_as_decodes = True


# How far a logprob may move. A float32 cache: the two attentions' different summation orders
# only. An int8 cache: a last-bit difference upstream (here the first layer's attention) can
# round one of the next layer's K/V codes the other way, a step of max|x| / 127, and on this
# random tiny model (head size 16, large weights) that moved three prompt logprobs by up to
# 0.065; any chunk size or batch split does the same (test_quantization.py). So there most
# positions must still agree to 1e-4, none by more than 0.2 (a causality or length error moves
# nearly all of them, by far more).
TOLERANCE = {"auto": (1e-4, 1.0), "int8": (0.2, 0.9)}  # (any position, share within 1e-4)


@needs_kernels
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_prompt_rows_as_decodes_match_sdpa(tiny_llama_dir, kv_cache_dtype):
    llm = LLM(tiny_llama_dir, kv_cache_memory="16MiB", quantization="int4", kv_cache_dtype=kv_cache_dtype,
              long_prefill_token_threshold=8, enable_prefix_caching=True)  # fmt: skip
    runner = llm.llm_engine.model_runner
    assert runner.attn_backend.prompt_rows_as_decodes  # the stack applies here

    got, seen = _run(llm, True)
    assert any(prompt and not chunks for prompt, chunks in seen)  # prompt rows went as decode rows
    assert not any(prompt and chunks for prompt, chunks in seen)
    want, seen = _run(llm, False)
    assert all(chunks for prompt, chunks in seen if prompt)

    n = len(PROMPTS)
    assert min(o.num_cached_tokens for o in got[n:]) >= 32  # the second pass: the prefix's blocks
    diffs = []
    for i, (a, b) in enumerate(zip(want[:n], got[:n])):
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(PROMPTS[i])
        pairs = zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], PROMPTS[i][1:])
        diffs += [abs(x[t] - y[t]) for x, y, t in pairs]
    for a, b in zip(want, got, strict=True):  # the sampled tokens' logprobs while both agree
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        pairs = enumerate(zip(a.outputs[0].logprobs, b.outputs[0].logprobs, tb))
        diffs += [abs(x[t] - y[t]) for k, (x, y, t) in pairs if ta[: k + 1] == tb[: k + 1]]
    most, share = TOLERANCE[kv_cache_dtype]
    assert max(diffs) <= most, max(diffs)
    assert sum(d <= 1e-4 for d in diffs) >= share * len(diffs), sorted(diffs)[-10:]
    for i, (a, b) in enumerate(zip(want, got)):  # tokens equal, or parted at a tie that close
        assert_quantized_match(a.outputs[0], b.outputs[0].token_ids, f"prompt {i % n}", tie=2 * max(diffs))


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy tokens and their logprobs (the same bits or not: compared exactly)."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]  # fmt: skip


LONG = [(11 * j + 5) % 300 + 2 for j in range(300)]  # one 300-token chunk: 45K attended pairs


@needs_kernels
@pytest.mark.parametrize(
    ("model", "kv_cache_dtype"),
    [("llama", "int8"), ("biased qwen2", "int8"), ("llama", "fp8_e4m3"), ("llama with a draft", "int8")],
)
def test_greedy_results_are_the_same_bits_alone_beside_a_long_prompt_and_preempted(
    request, tiny_llama_dir, model, kv_cache_dtype
):
    """Batch invariance of the stack path (int4 weights, int8 KV): short prompts alone and in
    their first step beside a 300-token prompt chunk; 200-token prompts alone and, in a pool of
    27 blocks, preempted and recomputed in one chunk. Before every chunk went as decode
    rows, chunks past 16K (query, key) pairs took SDPA (for the whole step): the short prompts'
    logprobs moved, and so did the recomputed decodes'. Before round 40 a biased model (Qwen2's
    q, k, v), an fp8 cache and a draft model (its float layers sharing the step's metadata) kept
    SDPA for every chunk, and moved the same way."""
    path = request.getfixturevalue("tiny_biased_dirs")["qwen2"] if "qwen2" in model else tiny_llama_dir
    engine = dict(quantization="int4", kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False)
    if "draft" in model:  # the float model drafting for its int4 self: most drafts accepted
        engine |= dict(speculative_method="draft", speculative_model=tiny_llama_dir)
    llm = LLM(path, kv_cache_memory="16MiB", **engine)
    alone = [_greedy(llm, [p])[0] for p in PROMPTS]
    assert _greedy(llm, [LONG] + PROMPTS)[1:] == alone
    if "draft" in model:  # verify rows are decode rows: the same bits as without speculation
        plain = {k: v for k, v in engine.items() if not k.startswith("speculative")}
        assert _greedy(LLM(path, kv_cache_memory="16MiB", **plain), PROMPTS) == alone

    longer = [LONG[i : i + 200] for i in range(0, 80, 20)]
    alone = [_greedy(llm, [p])[0] for p in longer]
    # 27 blocks of 16: two prompts' 13 blocks each, not the 28 both grow to by their last token
    small = LLM(path, kv_cache_memory=27 * 16 * llm.llm_engine.pool_size.bytes_per_token, **engine)
    assert small.llm_engine.pool_size.num_blocks == 27
    seen = []
    schedule = small.llm_engine.core.scheduler.schedule

    def counting():
        out = schedule()
        seen.append(out.num_preempted)
        return out

    small.llm_engine.core.scheduler.schedule = counting
    assert _greedy(small, longer) == alone
    assert sum(seen) > 0  # the pool forced preemptions
