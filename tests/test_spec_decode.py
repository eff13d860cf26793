"""Speculative decoding: greedy output equals the reference with and without speculation
(n-gram and draft-model proposers, mixed batches, forced preemption), sampling keeps the
target's distribution (chi-square), and no KV block is leaked."""

from __future__ import annotations

import pytest
import torch
from conftest import load_reference
from helpers import assert_greedy_match, reference_greedy

from kvserve import LLM, SamplingParams
from kvserve.bench.server_stats import scrape_spec_counters, spec_decode_summary
from kvserve.model.layers.sampler import Sampler
from kvserve.request import Request
from kvserve.spec_decode.adaptive import SpecState
from kvserve.spec_decode.ngram import NgramProposer


def _prompts(tokenizer) -> list[list[int]]:
    """Prompts with repeats (so n-grams match) of varied lengths, plus two short ones."""
    text = "red green blue red green blue yellow red green blue one two three one two three four "
    ids = tokenizer.encode(text * 6, add_special_tokens=False)
    return [ids[:n] for n in (40, 75, 110, 23)] + [ids[3:5], ids[7:8]]


def _assert_no_leak(llm: LLM) -> None:
    kv = llm.llm_engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks, "KV blocks leaked"
    assert all(c == 0 for c in kv.pool.ref_cnt), "a block is still referenced"


def _spec(llm: LLM):
    return llm.llm_engine.core.scheduler.spec_stats


def _engines(path: str, draft: str | None, **kw):
    method = dict(speculative_method="draft", speculative_model=draft) if draft else {}
    if not draft:
        method = dict(speculative_method="ngram", speculative_ngram_min=1)
    return LLM(path, kv_cache_memory="16MiB", **kw), LLM(path, kv_cache_memory="16MiB", **method, **kw)


@pytest.mark.parametrize("proposer", ["ngram", "draft-self", "draft-other"])
def test_greedy_equals_reference_with_speculation(proposer, tiny_llama_dir, tiny_qwen2_dir):
    draft = {"ngram": None, "draft-self": tiny_llama_dir, "draft-other": tiny_qwen2_dir}[proposer]
    ref = load_reference(tiny_llama_dir)
    plain, spec = _engines(tiny_llama_dir, draft)
    prompts = _prompts(plain.tokenizer)
    # Mixed batch: long generations next to requests that finish after one or two tokens.
    params = [SamplingParams(temperature=0, max_tokens=m) for m in (60, 45, 60, 30, 1, 2)]
    base = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    eos = sorted(spec.llm_engine.eos_token_ids)
    for i, p in enumerate(prompts):
        expected = reference_greedy(ref, p, params[i].max_tokens, eos)
        assert_greedy_match(ref, p, expected, base[i], f"plain, prompt {i}")
        assert got[i] == base[i], f"{proposer}: prompt {i} changed by speculation"
    stats = _spec(spec)
    print(proposer, stats)
    assert stats.num_drafts > 10
    if proposer == "draft-other":  # an unrelated random model: every draft rejected, backed off
        assert stats.num_draft_tokens < 4 * stats.num_drafts
    else:
        assert stats.num_accepted_tokens > 0
    if proposer == "draft-self":  # the target as its own draft agrees with itself
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    _assert_no_leak(spec)


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_speculation_survives_preemption_and_chunking(proposer, tiny_llama_dir):
    plain = LLM(tiny_llama_dir, kv_cache_memory="16MiB")
    prompts = _prompts(plain.tokenizer)
    params = SamplingParams(temperature=0, max_tokens=60)
    base = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    block_bytes = plain.llm_engine.pool_size.block_bytes * (2 if proposer == "draft" else 1)
    kw = dict(speculative_method="ngram", speculative_ngram_min=1)
    if proposer == "draft":
        kw = dict(speculative_method="draft", speculative_model=tiny_llama_dir)
    small = LLM(tiny_llama_dir, kv_cache_memory=14 * block_bytes, max_num_batched_tokens=9, **kw)
    got = [o.outputs[0].token_ids for o in small.generate(prompts, params, use_tqdm=False)]
    assert small.llm_engine.scheduler.num_preemptions_total > 0
    assert got == base
    assert _spec(small).num_accepted_tokens > 0
    _assert_no_leak(small)


def test_speculation_with_penalties_logprobs_min_tokens_and_stop(tiny_llama_dir):
    """Per-position sampling state (penalties, min_tokens, bad_words, allowed_token_ids) and
    outputs (logprobs, stop strings cut inside an accepted run) are what they would be without
    speculation."""
    plain, spec = _engines(tiny_llama_dir, None)
    prompts = _prompts(plain.tokenizer)[:4]
    text = plain.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]
    stop = text.outputs[0].text[25:29]  # a stop string somewhere inside the output
    ids = text.outputs[0].token_ids
    bad = plain.tokenizer.decode(ids[10:12])  # a two-token bad word: its ban reads the drafts before it
    for params in (
        SamplingParams(temperature=0, max_tokens=40, repetition_penalty=1.3, frequency_penalty=0.5),
        SamplingParams(temperature=0, max_tokens=40, min_tokens=30, logprobs=3),
        SamplingParams(temperature=0, max_tokens=40, stop=[stop]),
        SamplingParams(temperature=0, max_tokens=40, bad_words=[bad]),
        SamplingParams(temperature=0, max_tokens=40, allowed_token_ids=sorted(set(ids))),
    ):
        a = plain.generate(prompts, params, use_tqdm=False)
        b = spec.generate(prompts, params, use_tqdm=False)
        for x, y in zip(a, b):
            xo, yo = x.outputs[0], y.outputs[0]
            assert (xo.token_ids, xo.text, xo.finish_reason) == (yo.token_ids, yo.text, yo.finish_reason)
            if params.logprobs:
                for lx, ly in zip(xo.logprobs, yo.logprobs):
                    assert lx.keys() == ly.keys()
                    assert max(abs(lx[t] - ly[t]) for t in lx) < 1e-4
    assert _spec(spec).num_accepted_tokens > 0
    _assert_no_leak(spec)


def test_seeded_samples_are_the_same_with_speculation_preemption_and_chunking(tiny_llama_dir):
    """A seeded sampled request gives the tokens it gives without speculation, token for
    token, also when preemption and a small token budget change which drafts it verifies
    (each position draws from its own generator exactly as a step without drafts does)."""
    plain = LLM(tiny_llama_dir, kv_cache_memory="16MiB")
    block_bytes = plain.llm_engine.pool_size.block_bytes * 2  # the draft's KV too
    spec = LLM(
        tiny_llama_dir, kv_cache_memory=14 * block_bytes, max_num_batched_tokens=9,
        speculative_method="draft", speculative_model=tiny_llama_dir,  # greedy drafts: many accepted
    )  # fmt: skip
    prompts = _prompts(plain.tokenizer)
    params = [SamplingParams(temperature=0.3, seed=10 + i, max_tokens=30) for i in range(len(prompts))]
    base = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    stats = _spec(spec)
    assert spec.llm_engine.scheduler.num_preemptions_total > 0
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    assert got == base
    _assert_no_leak(spec)


def _chi_square_p(a: list[int], b: list[int]) -> float:
    """p-value of a chi-square homogeneity test of two samples of token ids (rare tokens pooled)."""
    tokens = sorted(set(a) | set(b))
    ca = torch.tensor([a.count(t) for t in tokens], dtype=torch.float64)
    cb = torch.tensor([b.count(t) for t in tokens], dtype=torch.float64)
    rare = (ca + cb) < 10
    if rare.any():
        ca = torch.cat([ca[~rare], ca[rare].sum(0, keepdim=True)])
        cb = torch.cat([cb[~rare], cb[rare].sum(0, keepdim=True)])
    table = torch.stack([ca, cb])
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum().item()
    dof = table.shape[1] - 1
    return 1.0 - torch.distributions.Chi2(torch.tensor(float(dof))).cdf(torch.tensor(stat)).item()


def test_rejection_sampler_keeps_the_target_distribution():
    """Sampler.verify on fixed logits: the first emitted token follows p exactly whether the
    draft is likely, unlikely or impossible under p (goodness of fit, many draws)."""
    torch.manual_seed(0)
    vocab = 12
    logits = torch.randn(3, vocab) * 1.5
    req = Request("r", [1, 2, 3], SamplingParams(temperature=0.8, top_p=0.9, max_tokens=5), 5, frozenset())
    sampler = Sampler(seed=1)
    probs = sampler._probs(logits.clone(), [req] * 3)[0]
    for draft in (int(probs.argmax()), int(probs.argsort()[-3]), int(probs.argmin())):
        firsts = [sampler.verify(logits.clone(), req, [draft, 5]).token_ids[0] for _ in range(6000)]
        counts = torch.bincount(torch.tensor(firsts), minlength=vocab).double()
        expected = probs.double() * len(firsts)
        keep = expected > 0
        assert counts[~keep].sum() == 0, "sampled a token that top-p removed"
        stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
        p = 1 - torch.distributions.Chi2(torch.tensor(float(keep.sum() - 1))).cdf(stat).item()
        assert p > 1e-3, f"draft {draft}: chi-square p={p:.2e}"


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_sampled_distribution_matches_without_speculation(top_p, tiny_llama_dir):
    """End to end: the 2nd-4th sampled tokens (where speculation acts) have the same
    distribution with and without speculation (chi-square, 1,200 samples each). The target
    drafts for itself greedily, so drafts are proposed every step and often rejected."""
    plain, spec = _engines(tiny_llama_dir, tiny_llama_dir, max_num_seqs=256, max_num_batched_tokens=2048)
    prompt = _prompts(plain.tokenizer)[0]
    n = 1200
    params = [SamplingParams(temperature=1.0, top_p=top_p, max_tokens=4, seed=i) for i in range(n)]
    outs = {}
    for name, llm in (("plain", plain), ("spec", spec)):
        res = llm.generate([prompt] * n, params, use_tqdm=False)
        outs[name] = [o.outputs[0].token_ids for o in res]
    stats = _spec(spec)
    assert stats.num_drafts > n and 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    for pos in (1, 2, 3):
        a = [t[pos] for t in outs["plain"] if len(t) > pos]
        b = [t[pos] for t in outs["spec"] if len(t) > pos]
        p = _chi_square_p(a, b)
        print(f"top_p={top_p} position {pos}: chi-square p={p:.3f}")
        assert p > 1e-3, f"position {pos}: distributions differ (p={p:.2e})"
    _assert_no_leak(spec)


def test_ngram_lookup():
    prop = NgramProposer(min_n=2, max_n=3)
    assert prop.lookup([1, 2, 3, 4, 5, 9, 2, 3], 3) == [4, 5, 9]
    assert prop.lookup([1, 2, 3, 4, 7, 2, 3, 5, 2, 3], 2) == [5, 2]  # most recent match
    assert prop.lookup([1, 2, 3, 4], 3) == []  # no repeated n-gram
    assert prop.lookup([5, 6, 7, 8, 6, 7, 8], 4) == [6, 7, 8]  # longest n first (6 7 8)
    assert prop.lookup([3], 2) == []


def test_adaptive_speculation_backs_off_and_recovers():
    s = SpecState(k=5)
    assert s.num_to_propose() == 5
    for _ in range(3):
        s.record(5, 0)
    assert s.pause > 0
    paused = [s.num_to_propose() for _ in range(s.pause)]
    assert paused == [0] * len(paused)
    assert s.num_to_propose() >= 1  # tries again after the pause
    for _ in range(6):
        s.record(s.num_to_propose() or 1, 5)
    assert s.num_to_propose() == 5 and s.pause == 0
    short = SpecState(k=5)
    for _ in range(4):
        short.record(2, 1)  # runs of about one token: propose about two, not five
    assert short.num_to_propose() <= 3


def test_draft_model_must_share_the_tokenizer(tiny_llama_dir):
    with pytest.raises(ValueError, match="speculative_model"):
        LLM(
            tiny_llama_dir,
            kv_cache_memory="4MiB",
            speculative_method="draft",
            speculative_model="smollm2-135m",
        )
    with pytest.raises(ValueError, match="speculative_method"):
        LLM(tiny_llama_dir, kv_cache_memory="4MiB", speculative_method="eagle")
    with pytest.raises(ValueError, match="speculative_model"):
        LLM(tiny_llama_dir, kv_cache_memory="4MiB", speculative_method="draft")


def test_context_stops_at_the_draft_model_s(tiny_llama_dir, tmp_path):
    """A draft with a 64-token context caps the target's (as its default does); an explicit
    max_model_len past it was taken, and every step holding a position past 64 failed its
    requests (the draft's rotary tables end there), a 40-token prompt with 30 tokens to go
    among them. It is refused at start-up, naming the draft's context."""
    from conftest import _save_tiny

    short = _save_tiny(str(tmp_path / "short-draft"), "qwen2", max_position_embeddings=64)
    kw = dict(kv_cache_memory="4MiB", speculative_method="draft", speculative_model=short)
    with pytest.raises(ValueError, match="max_model_len: 512 exceeds the draft model's context length 64"):
        LLM(tiny_llama_dir, max_model_len=512, **kw)
    llm = LLM(tiny_llama_dir, **kw)
    assert llm.llm_engine.max_model_len == 64
    prompt = list(range(3, 43))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(tiny_llama_dir, kv_cache_memory="4MiB").generate([prompt], params, use_tqdm=False)[0]
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids


@pytest.mark.slow
def test_default_model_ngram_matches_reference(default_reference):
    """The default model copying a passage: n-gram speculation accepts long runs and the
    output still equals transformers' greedy output."""
    passage = (
        "The keeper climbed the stairs at dusk with a brass lantern, a green notebook and a "
        "thermos of tea. He cleaned the lens, checked the wick and wrote down the wind. "
    ) * 2
    msgs = [{"role": "user", "content": "Repeat this text exactly:\n\n" + passage}]
    spec = LLM("smollm2-135m", kv_cache_memory="128MiB", speculative_method="ngram")
    params = SamplingParams(temperature=0, max_tokens=80)
    out = spec.chat([msgs], params, use_tqdm=False)[0]
    expected = reference_greedy(
        default_reference, out.prompt_token_ids, 80, sorted(spec.llm_engine.eos_token_ids)
    )
    assert_greedy_match(default_reference, out.prompt_token_ids, expected, out.outputs[0].token_ids, "ngram")
    stats = _spec(spec)
    print(stats)
    assert stats.num_accepted_tokens > 0.5 * stats.num_draft_tokens
    _assert_no_leak(spec)


def test_server_with_ngram_speculation(tiny_llama_dir):
    """Over HTTP (official client): streamed and non-streamed greedy text equal the offline
    engine without speculation, and the spec_decode counters are exported."""
    import openai
    from server_utils import ServerProcess

    plain = LLM(tiny_llama_dir, kv_cache_memory="16MiB")
    prompt = plain.tokenizer.decode(_prompts(plain.tokenizer)[1])
    expected = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=50), use_tqdm=False)[0]
    s = ServerProcess(
        tiny_llama_dir, "--kv-cache-memory", "16MiB", "--served-model-name", "tiny",
        "--speculative-method", "ngram", "--speculative-ngram-min", "1", "--metrics-require-key",
    )  # fmt: skip
    try:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key=s.api_key, max_retries=0)
        body = dict(model="tiny", prompt=prompt, max_tokens=50, temperature=0)
        before = scrape_spec_counters(s.url, s.api_key)
        assert before == {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
        # a --base-url ending in /v1 (which bench accepts) and a key-protected /metrics gave none
        assert scrape_spec_counters(f"{s.url}/v1/", s.api_key) == before
        assert scrape_spec_counters(s.url) is None  # 401 without the key
        full = client.completions.create(**body)
        assert full.choices[0].text == expected.outputs[0].text
        assert full.usage.completion_tokens == len(expected.outputs[0].token_ids)
        streamed = "".join(c.choices[0].text for c in client.completions.create(**body, stream=True))
        assert streamed == expected.outputs[0].text
        m = s.metrics()
        accepted = m["kvserve:spec_decode_num_accepted_tokens_total"]
        assert m["kvserve:spec_decode_num_drafts_total"] > 0
        assert m["kvserve:spec_decode_num_draft_tokens_total"] >= accepted > 0
        per_pos = m["kvserve:spec_decode_num_accepted_tokens_per_pos_total"]  # summed over positions
        assert per_pos == accepted
        # What `kvserve bench serve` reports for the run.
        summary = spec_decode_summary(before, scrape_spec_counters(s.url, s.api_key))
        assert summary["accepted_tokens"] == accepted
        assert summary["mean_acceptance_length"] == 1 + accepted / summary["drafts"]
    finally:
        s.stop()


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_speculation_with_structured_outputs(proposer, tiny_llama_dir):
    """Constrained requests under speculation: drafts the grammar refuses are rejected, the
    matcher is rolled back past rejected drafts, greedy output equals the non-speculative
    constrained output and sampled output still matches the format."""
    import re

    from kvserve import StructuredOutputsParams

    arith = 'root ::= num (op num){0,6}\nnum ::= [1-9] [0-9]{0,2}\nop ::= "+" | "-" | "*"'
    arith_re = re.compile(r"[1-9][0-9]{0,2}([-+*][1-9][0-9]{0,2}){0,6}")
    kw = dict(speculative_method="ngram", speculative_ngram_min=1)
    if proposer == "draft":  # the unconstrained model drafting: its guesses often break the grammar
        kw = dict(speculative_method="draft", speculative_model=tiny_llama_dir)
    plain = LLM(tiny_llama_dir, kv_cache_memory="16MiB", max_model_len=256)
    spec = LLM(tiny_llama_dir, kv_cache_memory="16MiB", max_model_len=256, **kw)
    cases = [
        StructuredOutputsParams(grammar=arith),
        StructuredOutputsParams(json={"type": "array", "items": {"type": "integer"}, "maxItems": 6}),
        StructuredOutputsParams(regex=r"(ab|ba){3,12}"),
        StructuredOutputsParams(regex=r"[a-z ]{1,80}"),  # loose enough for some unconstrained guesses
    ]
    prompts = _prompts(plain.tokenizer)[:4]
    greedy = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=so) for so in cases]
    a = plain.generate(prompts, greedy, use_tqdm=False)
    b = spec.generate(prompts, greedy, use_tqdm=False)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
    assert arith_re.fullmatch(b[0].outputs[0].text), b[0].outputs[0].text
    stats = _spec(spec)
    if proposer == "draft":  # the target drafting for itself within the grammar agrees with its
        # own constrained choices (unconstrained: 1 of 62 accepted; cut at the grammar: 3 drafted)
        assert 20 < stats.num_accepted_tokens == stats.num_draft_tokens, stats
    sampled = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=40, structured_outputs=cases[0]) for s in range(8)
    ]
    for out in spec.generate(prompts[:1] * 8, sampled, use_tqdm=False):
        assert out.outputs[0].finish_reason == "stop" and arith_re.fullmatch(out.outputs[0].text)
    assert _spec(spec).num_drafts > 0
    _assert_no_leak(spec)


def test_a_draft_that_ends_the_grammar(tiny_llama_dir):
    """An n-gram draft copying the prompt's end-of-text just where the grammar may end: the
    verification row after it has no next-token mask (the matcher has ended), and asking for one
    failed the request with finish_reason 'error'. Now it ends as it would without drafts."""
    from kvserve import StructuredOutputsParams

    llm = LLM(tiny_llama_dir, kv_cache_memory="4MiB", max_model_len=128, speculative_method="ngram",
              speculative_ngram_min=1)  # fmt: skip
    (a,) = llm.tokenizer.encode("a", add_special_tokens=False)
    (b,) = llm.tokenizer.encode("b", add_special_tokens=False)
    eos = min(llm.llm_engine.eos_token_ids)
    params = SamplingParams(
        temperature=0, max_tokens=10, structured_outputs=StructuredOutputsParams(regex="ab")
    )
    out = llm.generate([[a, b, eos] * 3], params, use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.text, out.finish_reason) == ([a, b, eos], "ab", "stop"), out
    assert _spec(llm).num_accepted_tokens == 2  # 'b' and the end, drafted and accepted
    _assert_no_leak(llm)
