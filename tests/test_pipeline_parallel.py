"""Pipeline parallelism: greedy output with PP=2 (two stage processes, gloo send / recv, one
torch thread each) equals PP=1 and the Hugging Face reference (near-tie rule), with chunked
prefill, prefix caching and preemption; two micro-batches are in flight at once; each stage's
KV pool holds only its layers, as `kvserve plan` computes; a request aborted while its step
is in the pipe is dropped cleanly; a dead stage fails the engine fast."""

from __future__ import annotations

import os
import signal
import time

import pytest
from conftest import load_reference
from helpers import assert_greedy_match, reference_greedy
from test_parallel import _alive, _greedy, _prompts, _shutdown

from kvserve import LLM, SamplingParams
from kvserve.core.kv_sizing import kv_pool_size, parse_memory_size
from kvserve.distributed.parallel_state import pipeline_layers
from kvserve.executor.multiproc import RankFailure
from kvserve.planner.plan import model_kv_bytes_per_token, resolve_precision
from kvserve.planner.presets import load_model_spec

GREEDY = SamplingParams(temperature=0, max_tokens=20)


def test_stage_layers_are_contiguous_and_cover_the_model():
    assert [pipeline_layers(30, 2, s) for s in range(2)] == [(0, 15), (15, 30)]
    assert [pipeline_layers(7, 3, s) for s in range(3)] == [(0, 3), (3, 5), (5, 7)]
    assert pipeline_layers(2, 2, 1) == (1, 2)


def test_config_refuses_what_pipeline_parallelism_does_not_run(tiny_llama_dir):
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        LLM(tiny_llama_dir, pipeline_parallel_size=2, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="pipeline_parallel_size: 3 stages for 2 layers"):
        LLM(tiny_llama_dir, pipeline_parallel_size=3, kv_cache_memory="1MiB")


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_llama_kv1_dir"])
def test_pp2_greedy_equals_pp1_and_reference(fixture, request):
    """Chunked prefill (32-token budget), prefix caching (a shared 40-token prefix, run twice)
    and preemption (a pool too small for the batch) with two batch streams in flight."""
    path = request.getfixturevalue(fixture)
    ref = load_reference(path)
    prompts = _prompts(500, [3, 9, 30, 57, 70], shared=40)
    # 20 blocks of 16 tokens per stage (one of the two layers each; the one-KV-head model's
    # blocks are half the size); the five requests need 24 even with their prefix cached.
    kw = dict(max_num_batched_tokens=32, max_model_len=256)
    pp1 = LLM(path, kv_cache_memory="80KiB", **kw)
    base = _greedy(pp1, prompts)
    memory = "40KiB" if fixture == "tiny_llama_kv1_dir" else "80KiB"
    pp2 = LLM(path, pipeline_parallel_size=2, kv_cache_memory=memory, **kw)
    try:
        first, again = _greedy(pp2, prompts), _greedy(pp2, prompts)
        core = pp2.llm_engine.core
        assert core.scheduler.num_preemptions_total > 0
        assert core.kv_cache_manager.prefix_cache_hits > 0
        assert core.executor.max_in_flight == 2  # both stages busy at once
    finally:
        _shutdown(pp2)
    eos = sorted(pp1.llm_engine.eos_token_ids)
    for i, p in enumerate(prompts):
        expected = reference_greedy(ref, p, GREEDY.max_tokens, eos)
        assert_greedy_match(ref, p, expected, base[i], f"PP=1 vs reference, prompt {i}")
        for label, got in (("PP=2", first[i]), ("PP=2 cached", again[i])):
            assert_greedy_match(ref, p, base[i], got, f"{label} vs PP=1, prompt {i}")


def test_abort_while_in_the_pipe_and_a_dead_stage(tiny_llama_dir):
    """A request aborted while its step is in flight is dropped when the step returns (its
    blocks were freed at once); the others go on equal to PP=1. Then SIGKILL of stage 1 ends
    the engine within 2 s and leaves no stage process behind."""
    long = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = _prompts(500, [5, 11, 17, 23])
    pp1 = LLM(tiny_llama_dir, kv_cache_memory="1MiB")
    base = _greedy(pp1, prompts, long)
    pp2 = LLM(tiny_llama_dir, pipeline_parallel_size=2, kv_cache_memory="1MiB")
    engine, core = pp2.llm_engine, pp2.llm_engine.core
    pids = core.executor.pids
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, long)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for _ in range(4):
        for o in engine.step():
            tokens[o.request_id] = o.outputs[0].token_ids
    assert core.executor.num_in_flight >= 1
    in_pipe = next(r for r, _ in core._in_flight[0][1].scheduled)
    engine.abort_request([in_pipe.request_id])
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens[o.request_id] = o.outputs[0].token_ids
    assert core.kv_cache_manager.usage() == 0
    for i in range(len(prompts)):
        if str(i) != in_pipe.request_id:
            assert tokens[str(i)] == base[i], f"prompt {i}"

    engine.add_request("x", prompts[0], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    engine.step()
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1"):
        for _ in range(2000):
            engine.step()
    assert time.monotonic() - t0 < 2.0
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids), "a stage process outlived the failed engine"


@pytest.mark.slow
def test_default_model_pp2_matches_reference_and_plan(default_llm, default_reference):
    """SmolLM2-135M in two stages of 15 layers; each stage's KV pool is what `kvserve plan`
    computes for pp=2 (ceil(30 / 2) layers); each stage holds about half the weights."""
    prompts = _prompts(49152, [4, 17, 64, 130])
    pp2 = LLM("smollm2-135m", pipeline_parallel_size=2, kv_cache_memory="256MiB")
    try:
        got = _greedy(pp2, prompts)
        per_rank = pp2.llm_engine.core.executor.collective_rpc("weight_bytes")
        kv_bytes = pp2.llm_engine.core.executor.collective_rpc("kv_cache_bytes")
    finally:
        _shutdown(pp2)
    per_token = model_kv_bytes_per_token(load_model_spec("smollm2-135m"), resolve_precision("float32"), pp=2)
    assert pp2.llm_engine.pool_size == kv_pool_size(parse_memory_size("256MiB"), 16, per_token)
    assert kv_bytes == [pp2.llm_engine.pool_size.num_blocks * 16 * per_token] * 2
    whole = default_llm.llm_engine.model_runner.model.weight_bytes()
    # The tied embedding table lives on both ends (lookups on stage 0, logits on stage 1).
    assert max(per_rank) <= 0.65 * whole, (per_rank, whole)
    base = _greedy(default_llm, prompts)
    eos = sorted(default_llm.llm_engine.eos_token_ids)
    exact = 0
    for i, p in enumerate(prompts):
        expected = reference_greedy(default_reference, p, GREEDY.max_tokens, eos)
        assert_greedy_match(default_reference, p, expected, base[i], f"PP=1 vs reference, prompt {i}")
        exact += assert_greedy_match(default_reference, p, base[i], got[i], f"PP=2 vs PP=1, prompt {i}")
    assert exact >= len(prompts) - 1, "more than one near-tie: suspicious"


def test_pp2_with_int8_weights_int8_kv_and_ngram_speculation(tiny_llama_dir):
    """Each stage quantizes its own layers exactly as one process does; n-gram drafts are
    verified through the last stage's logits, two streams in flight."""
    ref = load_reference(tiny_llama_dir)
    kw = dict(
        kv_cache_memory="2MiB", quantization="int8", kv_cache_dtype="int8", speculative_method="ngram",
        speculative_ngram_min=1, max_model_len=256,
    )  # fmt: skip
    pp1 = LLM(tiny_llama_dir, **kw)
    text = "red green blue red green blue yellow red green blue one two three one two three four " * 4
    ids = pp1.tokenizer.encode(text, add_special_tokens=False)
    prompts = [ids[:n] for n in (40, 75, 23)]  # repeats, so n-grams match
    params = SamplingParams(temperature=0, max_tokens=40)
    base = _greedy(pp1, prompts, params)
    pp2 = LLM(tiny_llama_dir, pipeline_parallel_size=2, **kw)
    try:
        got = _greedy(pp2, prompts, params)
        assert pp2.llm_engine.scheduler.spec_stats.num_drafts > 5
        assert pp2.llm_engine.core.executor.max_in_flight == 2
    finally:
        _shutdown(pp2)
    for i, p in enumerate(prompts):
        assert_greedy_match(ref, p, base[i], got[i], f"int8 PP=2 vs PP=1, prompt {i}")


def test_rpc_while_a_step_is_in_flight(tiny_llama_dir):
    """A collective RPC (stats, weight bytes) between pipelined steps: the step's answer that
    arrives meanwhile is kept for its collect, and the output is unchanged."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = _prompts(500, [5, 11, 17, 23])
    base = _greedy(LLM(tiny_llama_dir, kv_cache_memory="1MiB"), prompts, params)
    pp2 = LLM(tiny_llama_dir, pipeline_parallel_size=2, kv_cache_memory="1MiB")
    engine = pp2.llm_engine
    try:
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                tokens[o.request_id] = o.outputs[0].token_ids
            if engine.core.executor.num_in_flight:
                assert [s["steps"] >= 0 for s in engine.core.executor.collective_rpc("stats")] == [True] * 2
    finally:
        _shutdown(pp2)
    assert [tokens[str(i)] for i in range(len(prompts))] == base


def test_pp2_beams_and_forked_samples(tiny_llama_dir):
    """Forks (beam search, n > 1 from one prefill) live in their parent's batch stream and
    their block copies reach every stage: PP=2 beams equal transformers' num_beams, and
    seeded n=3 samples equal PP=1's."""
    from test_beam_search import PROMPTS, beams, reference_beams

    ref = load_reference(tiny_llama_dir)
    sampled = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12)
    pp1 = LLM(tiny_llama_dir, kv_cache_memory="2MiB")
    base = [c.token_ids for c in pp1.generate([PROMPTS[0]], sampled, use_tqdm=False)[0].outputs]
    pp2 = LLM(tiny_llama_dir, pipeline_parallel_size=2, kv_cache_memory="2MiB")
    try:
        for prompt in PROMPTS:
            assert beams(pp2, prompt, 4, 10) == reference_beams(ref, prompt, 4, 10)
        got = [c.token_ids for c in pp2.generate([PROMPTS[0]], sampled, use_tqdm=False)[0].outputs]
        assert got == base
        kv = pp2.llm_engine.core.kv_cache_manager
        assert kv.num_free_blocks == kv.num_blocks
    finally:
        _shutdown(pp2)
