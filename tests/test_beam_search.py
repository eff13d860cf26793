"""Beam search against transformers' `generate(num_beams=k)` on the tiny random Llama, and the
copy-on-write block sharing it is built on (issue 23)."""

from __future__ import annotations

import httpx
import pytest
import torch
from conftest import load_reference
from server_utils import ServerProcess

from kvserve import LLM, SamplingParams
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.request import Request
from kvserve.sampling_params import BeamSearchParams

PROMPTS = [
    [1, 5, 9, 33, 70, 100, 7],
    [1, 200, 3, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 12],
]
STOP = 54  # a token these beams produce often: as a stop token it exercises finished hypotheses


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    return load_reference(tiny_llama_dir)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, kv_cache_memory="4MiB")


@torch.inference_mode()
def reference_beams(model, prompt, k, max_new_tokens, eos=(2,), **kw) -> list[list[int]]:
    """transformers' k best beams, generated tokens only (each cut at its own length)."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), num_beams=k, num_return_sequences=k, do_sample=False,
        max_new_tokens=max_new_tokens, eos_token_id=list(eos), pad_token_id=0,
        return_dict_in_generate=True, output_logits=True, **kw,
    )  # fmt: skip
    seqs = out.sequences[:, len(prompt) :].tolist()
    if k == 1:  # greedy search: no beam indices; the output ends at the first stop token
        seq = seqs[0]
        ends = [i for i, t in enumerate(seq) if t in eos]
        return [seq[: ends[0] + 1] if ends else seq]
    lengths = (out.beam_indices != -1).sum(dim=1).tolist()
    return [s[:n] for s, n in zip(seqs, lengths)]


def beams(llm, prompt, k, max_tokens, **kw) -> list[list[int]]:
    params = SamplingParams(n=k, use_beam_search=True, max_tokens=max_tokens, **kw)
    return [c.token_ids for c in llm.generate([prompt], params, use_tqdm=False)[0].outputs]


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("length_penalty", [1.0, 0.5, 2.0])
def test_beams_equal_transformers(llm, reference, k, length_penalty):
    for prompt in PROMPTS:
        expected = reference_beams(reference, prompt, k, 10, length_penalty=length_penalty)
        assert beams(llm, prompt, k, 10, length_penalty=length_penalty) == expected


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("early_stopping", [False, True, "never"])
@pytest.mark.parametrize("length_penalty", [1.0, 0.5])
def test_stop_tokens_and_early_stopping_equal_transformers(llm, reference, k, early_stopping, length_penalty):
    """A stop token ends hypotheses at different lengths, so length_penalty and early_stopping
    decide which are returned and when the search ends (transformers: both ids are EOS)."""
    kw = dict(length_penalty=length_penalty, early_stopping=early_stopping)
    for prompt in PROMPTS:
        expected = reference_beams(reference, prompt, k, 16, eos=(2, STOP), **kw)
        assert beams(llm, prompt, k, 16, stop_token_ids=[STOP], **kw) == expected


def test_width_one_is_greedy(llm, reference):
    for prompt in PROMPTS:
        greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
        assert beams(llm, prompt, 1, 12) == [greedy[0].outputs[0].token_ids]
        assert beams(llm, prompt, 1, 12) == reference_beams(reference, prompt, 1, 12)


def test_finish_reasons_and_pool_is_free_after(llm):
    kv = llm.llm_engine.kv_cache_manager
    params = SamplingParams(n=4, use_beam_search=True, max_tokens=16, stop_token_ids=[STOP])
    out = llm.generate(PROMPTS, params, use_tqdm=False)
    assert all(any(c.token_ids[-1] == STOP for c in o.outputs) for o in out)  # some hypotheses stopped
    for o in out:
        assert [c.index for c in o.outputs] == [0, 1, 2, 3]
        for c in o.outputs:
            assert c.finish_reason == ("stop" if c.token_ids[-1] == STOP else "length")
            assert c.stop_reason == (STOP if c.finish_reason == "stop" else None)
    assert kv.num_free_blocks == kv.num_blocks
    assert not llm.llm_engine.core.beams.groups


def test_four_beams_hold_a_500_token_prompt_once(tiny_llama_dir, reference):
    """The beams share the prompt's full blocks (one reference each, never a copy); each has
    its own copy of the partly filled last block and its own blocks after it."""
    llm = LLM(tiny_llama_dir, kv_cache_memory="8MiB")
    engine = llm.llm_engine
    kv, bs = engine.kv_cache_manager, engine.config.block_size
    prompt = [1] + [(7 * i) % 500 + 3 for i in range(499)]
    full = len(prompt) // bs
    params = SamplingParams(n=4, use_beam_search=True, max_tokens=8)
    for j in range(4):
        engine.add_request(f"m{j}", prompt, params, group_id="g")
    finals, peak = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0].token_ids
        tables = [b for rid, b in kv.req_to_blocks.items() if "#beam" in rid]
        if len(tables) < 2:
            continue
        shared = tables[0][:full]
        for t in tables:
            assert t[:full] == shared  # the same physical blocks in every beam
        assert all(kv.pool.ref_cnt[b] == len(tables) for b in shared)
        distinct = set().union(*map(set, tables))
        assert len(distinct) <= full + len(tables) * -(-(len(prompt) % bs + 8) // bs)
        peak = max(peak, len(tables))
    assert peak == 4
    assert [finals[f"m{j}"] for j in range(4)] == reference_beams(reference, prompt, 4, 8)
    assert kv.num_free_blocks == kv.num_blocks


def test_copy_on_write_leaves_the_other_beams_kv_alone(tiny_llama_dir):
    """Two beams forked from one over a partly filled block: the first to write gets a copy,
    the other writes in place; both keep the shared positions' KV, and differ only where
    they wrote their own tokens."""
    llm = LLM(tiny_llama_dir, kv_cache_memory="4MiB")
    engine = llm.llm_engine
    kv, runner, bs = engine.kv_cache_manager, engine.model_runner, engine.config.block_size
    prompt = PROMPTS[1]  # 19 tokens: one full block + 3 tokens in the second
    engine.add_request("m0", prompt, SamplingParams(n=2, use_beam_search=True, max_tokens=4), group_id="g")
    engine.add_request("m1", prompt, SamplingParams(n=2, use_beam_search=True, max_tokens=4), group_id="g")
    engine.step()  # prefill, first search step: the root is forked into two beams
    ids = [rid for rid in kv.req_to_blocks if "#beam" in rid]
    assert len(ids) == 2
    a, b = (kv.req_to_blocks[r] for r in ids)
    assert a == b and kv.pool.ref_cnt[a[1]] == 2  # the partial block is shared, not copied yet
    before = runner.kv_cache[:, :, a[1]].clone()
    engine.step()  # both write their first generated token at position 19
    a, b = (kv.req_to_blocks[r] for r in ids)
    assert a[0] == b[0] and a[1] != b[1]  # full block still shared; the partial one copied once
    assert kv.pool.ref_cnt[a[1]] == kv.pool.ref_cnt[b[1]] == 1
    off = len(prompt) % bs
    for blk in (a[1], b[1]):
        torch.testing.assert_close(runner.kv_cache[:, :, blk, :, :off], before[:, :, :, :off], rtol=0, atol=0)
    assert not torch.equal(runner.kv_cache[:, :, a[1], :, off], runner.kv_cache[:, :, b[1], :, off])
    while engine.has_unfinished_requests():
        engine.step()
    assert kv.num_free_blocks == kv.num_blocks


def test_manager_fork_and_copy_on_write():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    parent = Request("p", list(range(6)), SamplingParams(), 8, frozenset())
    assert kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    child = parent.fork("c")
    kv.fork(parent, child)
    shared = list(kv.get_block_ids("p"))
    assert kv.get_block_ids("c") == shared and [kv.pool.ref_cnt[b] for b in shared] == [2, 2]
    for r in (parent, child):
        r.append_token(9)
    assert kv.allocate_slots(parent, 1)  # the first writer copies the partly filled block
    assert kv.get_block_ids("p")[0] == shared[0] and kv.get_block_ids("p")[1] != shared[1]
    copies, replaced = kv.take_copies()
    assert copies == [(shared[1], kv.get_block_ids("p")[1])] and replaced == {"p"}
    assert kv.allocate_slots(child, 1)  # the other now holds it alone: in place, no copy
    assert kv.get_block_ids("c") == shared and kv.take_copies() == ([], set())
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks == 8


def test_preemption_and_neighbours_do_not_change_beams(tiny_llama_dir, reference):
    """A pool too small for everything at once: beams and greedy requests preempt each other
    and are recomputed; every result still equals the reference."""
    llm = LLM(tiny_llama_dir, kv_cache_memory="96KiB", max_num_batched_tokens=32)
    engine = llm.llm_engine
    greedy = SamplingParams(temperature=0, max_tokens=24)
    prompts = [[1, 17 + i, 40, 41, 42 + i] * 4 for i in range(4)]
    outs = llm.generate(
        [PROMPTS[0], *prompts, PROMPTS[1]],
        [SamplingParams(n=4, use_beam_search=True, max_tokens=20)] + [greedy] * 4
        + [SamplingParams(n=2, use_beam_search=True, max_tokens=20)],
        use_tqdm=False,
    )  # fmt: skip
    assert engine.scheduler.num_preemptions_total > 0
    assert [c.token_ids for c in outs[0].outputs] == reference_beams(reference, PROMPTS[0], 4, 20)
    assert [c.token_ids for c in outs[-1].outputs] == reference_beams(reference, PROMPTS[1], 2, 20)
    for p, o in zip(prompts, outs[1:5]):
        assert o.outputs[0].token_ids == reference_beams(reference, p, 1, 24)[0]
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks


def test_beams_with_speculative_neighbours(tiny_llama_dir, reference):
    llm = LLM(tiny_llama_dir, kv_cache_memory="4MiB", speculative_method="ngram", num_speculative_tokens=3)
    outs = llm.generate(
        [PROMPTS[0], PROMPTS[1] * 2],
        [
            SamplingParams(n=2, use_beam_search=True, max_tokens=12),
            SamplingParams(temperature=0, max_tokens=12),
        ],
        use_tqdm=False,
    )
    assert [c.token_ids for c in outs[0].outputs] == reference_beams(reference, PROMPTS[0], 2, 12)
    assert outs[1].outputs[0].token_ids == reference_beams(reference, PROMPTS[1] * 2, 1, 12)[0]


@pytest.mark.parametrize(
    "field, kw",
    [
        ("logprobs", {"logprobs": 1}),
        ("stop", {"stop": ["x"]}),
        ("early_stopping", {"early_stopping": "sometimes"}),
        ("repetition_penalty", {"repetition_penalty": 1.2}),
    ],
)
def test_unsupported_combinations_name_the_field(field, kw):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(n=2, use_beam_search=True, **kw)


def test_http_completions_and_chat(llm, tiny_llama_dir, reference, tmp_path):
    s = ServerProcess(tiny_llama_dir, "--kv-cache-memory", "4MiB", log_path=str(tmp_path / "serve.log"))
    try:
        headers = {"Authorization": f"Bearer {s.api_key}"}
        body = {"prompt": PROMPTS[0], "max_tokens": 8, "n": 2, "use_beam_search": True, "length_penalty": 0.5}
        r = httpx.post(f"{s.url}/v1/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        # The same choices as the offline engine, whose tokens equal transformers' (the text
        # goes through the same detokenizer, which holds back incomplete UTF-8 at the end).
        params = SamplingParams(n=2, use_beam_search=True, max_tokens=8, length_penalty=0.5)
        offline = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs
        expected = reference_beams(reference, PROMPTS[0], 2, 8, length_penalty=0.5)
        assert [c.token_ids for c in offline] == expected
        assert [c["text"] for c in r.json()["choices"]] == [c.text for c in offline]
        assert [c["index"] for c in r.json()["choices"]] == [0, 1]

        hello = [{"role": "user", "content": "Hello"}]
        chat = {"messages": hello, "max_tokens": 6, "n": 3, "use_beam_search": True}
        r = httpx.post(f"{s.url}/v1/chat/completions", json=chat, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 3
        # Past the KV pool, the refusal names the length field the client sent; one it did not send
        # ("max_tokens=236" read as the client's value) is said as unset.
        wide = {"messages": hello, "n": 100, "use_beam_search": True}
        for extra, words in (
            ({}, "beams of up to "),
            ({"max_completion_tokens": 200}, "max_completion_tokens=200"),
        ):
            r = httpx.post(
                f"{s.url}/v1/chat/completions", json={**wide, **extra}, headers=headers, timeout=60
            )
            err = r.json()["error"]
            assert err["param"] == "n" and words in err["message"] and "max_tokens=" not in err["message"], (
                err
            )

        r = httpx.post(f"{s.url}/v1/completions", json={**body, "stream": True}, headers=headers, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
        r = httpx.post(f"{s.url}/v1/completions", json={**body, "logprobs": 1}, headers=headers, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    finally:
        s.stop()


def test_tp2_beams_copy_blocks_on_every_rank(tiny_llama_dir, reference):
    """Under tensor parallelism each rank holds its heads' KV: the block copies travel in the
    step to both ranks, so TP=2 beams equal transformers too."""
    llm = LLM(tiny_llama_dir, tensor_parallel_size=2, kv_cache_memory="2MiB")
    try:
        for prompt in PROMPTS:
            assert beams(llm, prompt, 4, 10) == reference_beams(reference, prompt, 4, 10)
    finally:
        llm.llm_engine.core.shutdown()


@torch.inference_mode()
def plain_beam_search(model, prompt, k, steps) -> list[tuple[list[int], float]]:
    """The textbook search with no stop token: each step, every beam's continuations by
    transformers' logits, the k of highest summed logprob kept."""
    beams = [(list(prompt), 0.0)]
    for _ in range(steps):
        cands = []
        for toks, cum in beams:
            lp = model(torch.tensor([toks])).logits[0, -1].float().log_softmax(-1)
            top = lp.topk(2 * k)
            cands += [(toks + [t], cum + v) for v, t in zip(top.values.tolist(), top.indices.tolist())]
        beams = sorted(cands, key=lambda c: -c[1])[:k]
    return beams


@pytest.mark.parametrize("k", [1, 3])
def test_llm_beam_search_equals_a_plain_beam_search(llm, reference, k):
    """vLLM's LLM.beam_search(prompts, BeamSearchParams(...)) was missing (AttributeError): the
    sequences hold prompt + generated tokens, their text and summed logprob, best first."""
    tok = llm.get_tokenizer()
    outs = llm.beam_search(
        [{"prompt_token_ids": p} for p in PROMPTS],
        BeamSearchParams(beam_width=k, max_tokens=6, ignore_eos=True),
    )
    assert len(outs) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outs):
        expected = plain_beam_search(reference, prompt, k, 6)
        assert [s.tokens for s in out.sequences] == [toks for toks, _ in expected]
        for s, (_, cum) in zip(out.sequences, expected):
            assert s.cum_logprob == pytest.approx(cum, abs=1e-3)
            assert s.text == tok.decode(s.tokens) and s.finish_reason == "length" and s.logprobs == []


def test_llm_beam_search_width_one_is_greedy(llm):
    params = BeamSearchParams(beam_width=1, max_tokens=12)
    greedy = llm.generate(
        ["a paged cache", PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False
    )
    outs = llm.beam_search(["a paged cache", PROMPTS[0]], params, concurrency_limit=1)
    for g, out in zip(greedy, outs):
        (seq,) = out.sequences
        generated = g.outputs[0].token_ids
        if g.outputs[0].finish_reason == "stop":  # vLLM's beams leave the end-of-sequence token out
            generated = generated[:-1]
        assert seq.tokens == g.prompt_token_ids + generated


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(beam_width=2, max_tokens=4, temperature=0.7), "temperature: must be 0"),
        (dict(beam_width=0, max_tokens=4), "beam_width: must be >= 1"),
        (dict(beam_width=2, max_tokens=0), "max_tokens: must be >= 1"),
    ],
)
def test_beam_search_params_name_the_field(kwargs, words):
    with pytest.raises(ValueError, match=words):
        BeamSearchParams(**kwargs)


def test_llm_beam_search_errors_name_its_own_fields(tiny_llama_dir):
    """Refusals came in generate's words: the width as `n`, and with concurrency_limit a
    prompt's index within its chunk."""
    small = LLM(tiny_llama_dir, kv_cache_memory="256KiB", max_model_len=512)
    params = BeamSearchParams(beam_width=8, max_tokens=100, ignore_eos=True)
    with pytest.raises(ValueError, match=r"^prompt 0: beam_width: 8 beams of max_tokens=100 need"):
        small.beam_search([[5] * 100], params)
    with pytest.raises(ValueError, match=r"^prompt 2: prompt: must not be empty"):
        small.beam_search(["a", "b", ""], BeamSearchParams(beam_width=2, max_tokens=2), concurrency_limit=2)
    assert not small.llm_engine.has_unfinished_requests()


def test_llm_beam_search_leaves_the_end_of_sequence_out(tmp_path):
    """As vLLM's: a beam ended by the model's EOS holds neither the token nor its text, unless
    include_stop_str_in_output (here the tiny model's EOS is a token its beams produce)."""
    from conftest import _save_tiny

    llm = LLM(_save_tiny(str(tmp_path), "llama", eos_token_id=STOP), kv_cache_memory="4MiB")
    tok = llm.get_tokenizer()
    params = dict(beam_width=4, max_tokens=16)
    cut = llm.beam_search(PROMPTS, BeamSearchParams(**params))
    kept = llm.beam_search(PROMPTS, BeamSearchParams(**params, include_stop_str_in_output=True))
    stopped = 0
    for a, b in zip(cut, kept):
        for s, t in zip(a.sequences, b.sequences):
            assert (
                s.cum_logprob == pytest.approx(t.cum_logprob, abs=1e-4) and s.finish_reason == t.finish_reason
            )
            if s.finish_reason == "stop":
                stopped += 1
                assert s.stop_reason is None and t.tokens == [*s.tokens, STOP] and STOP not in s.tokens[-1:]
                assert t.text == tok.decode(t.tokens) and s.text == tok.decode(s.tokens)
            else:
                assert s.tokens == t.tokens
    assert stopped
