"""Bad requests and settings raise ValueError naming the field, and never break the engine:
requests already in flight finish normally and every KV block comes back."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams

MAX_MODEL_LEN = 64
BLOCK_BYTES = 16 * 512  # block_size 16 x (2 layers * 2 (K,V) * 2 kv heads * 16 head dim * 4 bytes)
NUM_BLOCKS = 3
GOOD = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    # 3 blocks of 16 tokens (48 tokens) and a 64-token context: both limits are reachable.
    llm = LLM(tiny_llama_dir, kv_cache_memory=NUM_BLOCKS * BLOCK_BYTES, max_model_len=MAX_MODEL_LEN)
    assert llm.llm_engine.kv_cache_manager.num_blocks == NUM_BLOCKS
    assert llm.llm_engine.max_model_len == MAX_MODEL_LEN
    return llm


@pytest.fixture(scope="module")
def reference(llm) -> dict[str, list[int]]:
    outs = llm.generate(["Hello world", "A paged KV cache"], GOOD, use_tqdm=False)
    return {"g1": outs[0].outputs[0].token_ids, "g2": outs[1].outputs[0].token_ids}


def assert_idle(llm: LLM) -> None:
    e = llm.llm_engine
    assert not e.has_unfinished_requests()
    assert not e.scheduler.requests and not e.scheduler.waiting and not e.scheduler.running
    assert e.kv_cache_manager.num_free_blocks == e.kv_cache_manager.num_blocks


# Each case: a call that must raise ValueError, and a word the message must contain.
BAD_REQUESTS = {
    "empty-text": (lambda e: e.add_request("bad", "", GOOD), r"prompt"),
    "empty-ids": (lambda e: e.add_request("bad", [], GOOD), r"prompt"),
    "too-long-prompt": (lambda e: e.add_request("bad", [5] * MAX_MODEL_LEN, GOOD), r"prompt.*max_model_len"),
    "too-long-text": (lambda e: e.add_request("bad", "The quick brown fox " * 40, GOOD), r"prompt"),
    "prompt+max_tokens": (
        lambda e: e.add_request("bad", [5] * 40, SamplingParams(max_tokens=30)),
        r"max_tokens.*max_model_len",
    ),
    "more-blocks-than-pool": (
        lambda e: e.add_request("bad", [5] * 10, SamplingParams(max_tokens=50)),
        r"max_tokens.*KV blocks",
    ),
    "token-id-too-large": (lambda e: e.add_request("bad", [5, 512], GOOD), r"prompt.*token ids"),
    "token-id-negative": (lambda e: e.add_request("bad", [5, -1], GOOD), r"prompt.*token ids"),
    "token-id-not-int": (lambda e: e.add_request("bad", [5, 3.0], GOOD), r"prompt.*token ids"),
    "logit-bias-out-of-range": (
        lambda e: e.add_request("bad", [5], SamplingParams(logit_bias={512: 1.0})),
        r"logit_bias",
    ),
    "n>1-in-engine": (lambda e: e.add_request("bad", [5], SamplingParams(n=2)), r"\bn\b"),
    "duplicate-id": (lambda e: e.add_request("g1", [5, 6], GOOD), r"request_id"),
    "max_tokens=0": (lambda e: SamplingParams(max_tokens=0), r"max_tokens"),
    "top_p=0": (lambda e: SamplingParams(top_p=0), r"top_p"),
    "top_p=1.5": (lambda e: SamplingParams(top_p=1.5), r"top_p"),
    "temperature=-1": (lambda e: SamplingParams(temperature=-1), r"temperature"),
    "top_k=-2": (lambda e: SamplingParams(top_k=-2), r"top_k"),
    "min_p=2": (lambda e: SamplingParams(min_p=2), r"min_p"),
    "min_tokens>max_tokens": (lambda e: SamplingParams(min_tokens=5, max_tokens=4), r"min_tokens"),
    "repetition_penalty=0": (lambda e: SamplingParams(repetition_penalty=0), r"repetition_penalty"),
    "frequency_penalty=3": (lambda e: SamplingParams(frequency_penalty=3), r"frequency_penalty"),
    "empty-stop-string": (lambda e: SamplingParams(stop=["ok", ""]), r"stop"),
    "logprobs=-2": (lambda e: SamplingParams(logprobs=-2), r"logprobs"),  # -1: the vocabulary, as vLLM
    "length_penalty-overflows": (
        lambda e: SamplingParams(n=2, use_beam_search=True, length_penalty=1e308),
        r"length_penalty",
    ),
    # Values that once passed validation and then broke a step (issue: hardening).
    "top_k>vocab": (lambda e: e.add_request("bad", [5], SamplingParams(top_k=2**63)), r"top_k"),
    "seed-past-64-bits": (lambda e: e.add_request("bad", [5], SamplingParams(seed=2**70)), r"seed"),
    "priority-past-int64": (lambda e: e.add_request("bad", [5], GOOD, priority=2**63), r"priority"),
    "min_tokens>resolved-max": (
        lambda e: e.add_request("bad", [5], SamplingParams(max_tokens=None, min_tokens=10**6)),
        r"min_tokens",
    ),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_raises_and_engine_keeps_serving(llm, reference, case):
    bad, field = BAD_REQUESTS[case]
    e = llm.llm_engine
    assert_idle(llm)
    e.add_request("g1", "Hello world", GOOD)
    e.add_request("g2", "A paged KV cache", GOOD)
    e.step()  # both good requests are now running and hold blocks
    used = e.kv_cache_manager.num_blocks - e.kv_cache_manager.num_free_blocks
    assert used == 2
    with pytest.raises(ValueError, match=field):
        bad(e)
    assert "bad" not in e.scheduler.requests
    assert e.kv_cache_manager.num_blocks - e.kv_cache_manager.num_free_blocks == used

    final = {}
    for _ in range(50):
        if not e.has_unfinished_requests():
            break
        for out in e.step():
            if out.finished:
                final[out.request_id] = out.outputs[0]
    assert set(final) == {"g1", "g2"}
    for rid, c in final.items():
        assert c.token_ids == reference[rid] and c.finish_reason == "length"
    assert_idle(llm)


def test_boundary_requests_are_accepted_and_rejected(llm):
    out = llm.generate([[5] * 41], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8  # 49 tokens, the last never cached: the whole 3-block pool
    out = llm.generate([[511, 0]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2  # ids 0 and vocab-1 are valid
    with pytest.raises(ValueError, match="KV blocks"):
        llm.generate([[5] * 42], SamplingParams(max_tokens=8), use_tqdm=False)  # 49 cached tokens: 4 blocks
    # No max_tokens: generate until the pool is full rather than refuse the request.
    out = llm.generate([[5] * 10], SamplingParams(max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == min(MAX_MODEL_LEN, 3 * 16 + 1) - 10
    assert_idle(llm)


def test_generate_reports_which_prompt_is_bad_and_cleans_up(llm, reference):
    with pytest.raises(ValueError, match=r"prompt 1: prompt"):
        llm.generate(["Hello world", "", "A paged KV cache"], GOOD, use_tqdm=False)
    assert_idle(llm)
    with pytest.raises(ValueError, match=r"prompt 0: prompt"):
        llm.generate([[]], GOOD, use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt"):
        llm.generate("", GOOD, use_tqdm=False)
    with pytest.raises(ValueError, match=r"sampling_params"):
        llm.generate(["Hello world", "A paged KV cache"], [GOOD], use_tqdm=False)
    assert llm.generate([], GOOD, use_tqdm=False) == []  # an empty batch, not an empty prompt
    assert_idle(llm)
    outs = llm.generate(["Hello world", "A paged KV cache"], GOOD, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [reference["g1"], reference["g2"]]


def test_generate_error_does_not_swallow_other_requests(llm, reference):
    e = llm.llm_engine
    e.add_request("g1", "Hello world", GOOD)
    try:
        with pytest.raises(ValueError, match="prompt 1"):
            llm.generate(["A paged KV cache", ""], GOOD, use_tqdm=False)
        assert e.has_unfinished_requests(), "g1 was run to completion by someone else's generate()"
    finally:
        while e.has_unfinished_requests():
            e.step()


def test_reusing_an_aborted_request_id(tiny_llama_dir):
    """An id may be reused right after abort_request, before the abort is reported."""
    llm = LLM(tiny_llama_dir, kv_cache_memory="1MiB")
    e = llm.llm_engine
    e.add_request("a", "Hello world", GOOD)
    e.step()
    e.abort_request("a")
    e.add_request("a", "Hello world", GOOD)  # either refused with ValueError or served
    finals = []
    for _ in range(50):
        if not e.has_unfinished_requests():
            break
        finals += [o.outputs[0].finish_reason for o in e.step() if o.finished]
    assert finals == ["abort", "length"]


# ---- engine construction ---------------------------------------------------------------------------
def test_missing_model_path_names_model(tmp_path):
    with pytest.raises((FileNotFoundError, ValueError), match=r"model"):
        LLM(str(tmp_path / "no-such-model"))
    with pytest.raises((FileNotFoundError, ValueError), match=r"model"):
        LLM(str(tmp_path))  # a directory without config.json


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(max_model_len=1000), "max_model_len"),  # the tiny model's context is 512
        (dict(max_model_len=0), "max_model_len"),
        (dict(kv_cache_memory=100), "kv_cache_memory"),  # less than one block
        (dict(block_size=0), "block_size"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
        (dict(dtype="int4"), "dtype"),
        (dict(kv_cache_memory="lots"), "kv_cache_memory"),
        (dict(kv_cache_memory=-1), "kv_cache_memory"),
        (dict(seed=2**64), "seed"),  # was "Overflow when unpacking long long", after the model loaded
        (dict(seed=-(2**63) - 1), "seed"),
    ],
)
def test_bad_engine_settings_name_the_field(tiny_llama_dir, kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM(tiny_llama_dir, **{"kv_cache_memory": "1MiB", **kwargs})


def test_vllm_dict_prompts_are_read_as_vllm_reads_them(llm, reference):
    """TextPrompt / TokensPrompt dicts: a dict was read as the list of its keys before, so
    {"prompt_token_ids": [...]} generated from the text "prompt_token_ids"."""
    ids = llm.tokenizer.encode("Hello world")
    one = llm.generate({"prompt_token_ids": ids}, GOOD, use_tqdm=False)
    assert one[0].outputs[0].token_ids == reference["g1"]
    outs = llm.generate(
        [{"prompt": "Hello world"}, {"prompt": "A paged KV cache", "cache_salt": "s"}], GOOD, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in outs] == [reference["g1"], reference["g2"]]
    for bad, word in (
        ({"prompt": "a", "prompt_token_ids": [5]}, "exactly one"),
        ({"text": "a"}, "exactly one"),
        ({"prompt": "a", "multi_modal_data": {}}, "multi_modal_data"),
    ):
        with pytest.raises(ValueError, match=word):
            llm.generate([{"prompt": "Hello world"}, bad], GOOD, use_tqdm=False)
    assert_idle(llm)
