"""Sampling on a tiny random model: seeds, greedy-equivalent filters, the sampled distribution,
top-k/top-p/min-p support, penalties, logprobs, min_tokens, stop token ids and logit bias."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from kvserve import LLM, SamplingParams

VOCAB = 512  # the tiny models' vocabulary (tests/conftest.py)
EOS = 2
PROMPT = "The quick brown fox"


def make_llm(path: str, **kwargs) -> LLM:
    # A fresh engine per test: a crash inside step() leaves its request stuck in the engine.
    return LLM(path, kv_cache_memory="64MiB", **kwargs)


def gen(llm: LLM, prompts, params) -> list:
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def greedy_ids(llm: LLM, prompt=PROMPT, n: int = 16) -> list[int]:
    return gen(llm, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0].token_ids


# ---- seeds ---------------------------------------------------------------------------------------
def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    alone = gen(llm, PROMPT, seeded)[0].token_ids
    assert gen(llm, PROMPT, seeded)[0].token_ids == alone, "same seed, same engine: must repeat"

    others = [
        SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=1, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=9),
        SamplingParams(temperature=1.3, top_k=5, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=99, top_p=0.9, max_tokens=3, ignore_eos=True),
    ]
    prompts = ["Hello world!", PROMPT, PROMPT, "A paged KV cache", "0123456789", PROMPT * 3]
    outs = gen(llm, prompts, others[:2] + [seeded] + others[2:])
    assert outs[2].token_ids == alone, "a seeded request must not depend on the rest of the batch"

    # A fresh engine (different global generator history) gives the same seeded sample too.
    assert gen(make_llm(tiny_llama_dir), PROMPT, seeded)[0].token_ids == alone


def test_different_seeds_differ_and_unseeded_samples_vary(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    samples = [
        gen(llm, PROMPT, SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True))[0].token_ids
        for s in (1, 2, 3)
    ]
    assert len({tuple(s) for s in samples}) == 3
    unseeded = gen(llm, [PROMPT] * 4, SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True))
    assert len({tuple(o.token_ids) for o in unseeded}) == 4


def test_n_samples_use_consecutive_seeds(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    p = SamplingParams(n=3, temperature=1.0, seed=50, max_tokens=8, ignore_eos=True)
    out = llm.generate(PROMPT, p, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for j, c in enumerate(out.outputs):
        single = SamplingParams(temperature=1.0, seed=50 + j, max_tokens=8, ignore_eos=True)
        assert c.token_ids == gen(llm, PROMPT, single)[0].token_ids


def test_n_samples_seeds_wrap_inside_64_bits(tiny_llama_dir):
    """The n samples of a seed at the top of the range wrap as the server's do (torch reads
    seeds modulo 2**64); seed + 1 was refused as past 64 bits."""
    llm = make_llm(tiny_llama_dir)
    top = 2**64 - 1
    out = llm.generate(PROMPT, SamplingParams(n=2, temperature=1.0, seed=top, max_tokens=6), use_tqdm=False)[
        0
    ]
    for c, seed in zip(out.outputs, (top, 0)):
        single = SamplingParams(temperature=1.0, seed=seed, max_tokens=6)
        assert c.token_ids == gen(llm, PROMPT, single)[0].token_ids


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(logit_bias={"5": 3.0}), "logit_bias: keys must be integer token ids"),
        (dict(logit_bias={5: float("nan")}), "logit_bias: values must be finite"),
        (dict(logit_bias={5: float("inf")}), "logit_bias: values must be finite"),
        (dict(stop_token_ids=["5"]), "stop_token_ids: must be integer token ids"),
        (dict(temperature=float("inf")), "temperature: must be a finite number"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty: must be a finite number"),
        (dict(top_k=2.5), "top_k: must be an integer"),
        (dict(logprobs=2.5), "logprobs: must be an integer"),
        (dict(max_tokens=3.5), "max_tokens: must be an integer"),
        (dict(seed=1.5), "seed: must be an integer"),
        (dict(n=True), "n: must be an integer"),
    ],
)
def test_mistyped_params_are_refused_naming_the_field(kw, words):
    """Offline callers get no pydantic in front: a wrong type or a non-finite weight is a
    ValueError at construction. They were an "engine failed" error from inside the step (a
    string bias key, a float logprobs), or silently ignored or sampled garbage (a string stop
    id, a NaN or infinite bias: token 0 every step, an infinite temperature)."""
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kw)


# ---- filters that reduce to greedy ---------------------------------------------------------------
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=1, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=1.0, min_p=1.0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=2.0, top_k=1, top_p=0.5, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=1e-6, max_tokens=16, ignore_eos=True),  # below 1e-5: greedy
    ],
    ids=["top_k=1", "top_p=1e-6", "min_p=1", "top_k=1+top_p", "temperature~0"],
)
def test_degenerate_filters_equal_greedy(tiny_llama_dir, params):
    llm = make_llm(tiny_llama_dir)
    expected = greedy_ids(llm)
    prompts = [PROMPT] * 4  # several rows: every one of them must be the argmax
    for out in gen(llm, prompts, params):
        assert out.token_ids == expected


# ---- the sampled distribution --------------------------------------------------------------------
def _peaked_context(llm: LLM) -> tuple[list[int], dict[int, float]]:
    """A token context whose next-token distribution has a top probability in [0.3, 0.8],
    and that full distribution (logprobs over the whole vocabulary)."""
    tok = llm.llm_engine.tokenizer
    for text in ["Hello world!", PROMPT, "A paged KV cache", "Continuous batching"]:
        prompt = tok.encode(text)
        out = gen(llm, [prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1))[0]
        for j, entry in enumerate(out.logprobs):
            if 0.3 <= math.exp(max(entry.values())) <= 0.8:
                ctx = prompt + out.token_ids[:j]
                full = gen(llm, [ctx], SamplingParams(temperature=0, max_tokens=1, logprobs=VOCAB))[0]
                return ctx, full.logprobs[0]
    raise AssertionError("no context with a moderately peaked distribution found")


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampled_frequencies_match_model_probabilities(tiny_llama_dir, temperature):
    llm = make_llm(tiny_llama_dir)
    ctx, dist = _peaked_context(llm)
    assert len(dist) == VOCAB
    assert abs(sum(math.exp(v) for v in dist.values()) - 1) < 1e-4
    # Tempered distribution: p_i^(1/T), renormalised.
    weights = {t: math.exp(v / temperature) for t, v in dist.items()}
    z = sum(weights.values())
    expected = {t: w / z for t, w in weights.items()}

    n = 600
    outs = gen(llm, [ctx] * n, SamplingParams(temperature=temperature, max_tokens=1, ignore_eos=True))
    counts = Counter(o.token_ids[0] for o in outs)
    ranked = sorted(expected, key=expected.get, reverse=True)
    for tok in ranked[:3]:
        p = expected[tok]
        sigma = math.sqrt(n * p * (1 - p))
        assert abs(counts[tok] - n * p) <= 4 * sigma + 1, (
            f"token {tok}: sampled {counts[tok]}/{n}, expected {n * p:.1f} ± {4 * sigma:.1f}, T={temperature}"
        )


def test_top_k_samples_only_from_the_k_best(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    k = 3
    p = SamplingParams(temperature=2.0, top_k=k, max_tokens=6, ignore_eos=True, logprobs=k)
    outs = gen(llm, [PROMPT, "Hello world!", "A paged KV cache"] * 10, p)
    seen_ranks = Counter()
    for out in outs:
        for tok, entry in zip(out.token_ids, out.logprobs):
            top = sorted(entry, key=entry.get, reverse=True)[:k]
            assert tok in top, f"token {tok} is not among the top {k} {top}"
            assert len(entry) == k  # the chosen token is one of the k returned alternatives
            seen_ranks[top.index(tok)] += 1
    assert len(seen_ranks) == k, "temperature 2 over the top 3 should hit every rank"


def test_top_p_samples_only_inside_the_nucleus(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    top_p = 0.3
    p = SamplingParams(temperature=1.0, top_p=top_p, max_tokens=6, ignore_eos=True, logprobs=VOCAB)
    outs = gen(llm, [PROMPT, "Hello world!", "A paged KV cache"] * 8, p)
    distinct = set()
    for out in outs:
        for tok, entry in zip(out.token_ids, out.logprobs):
            ranked = sorted(entry.values(), reverse=True)
            mass_before = sum(math.exp(v) for v in ranked if v > entry[tok])
            assert mass_before < top_p + 1e-5, f"token {tok} lies outside the top_p={top_p} nucleus"
            distinct.add(tok)
    assert len(distinct) > 24, "top_p=0.3 should still sample several tokens per context"


def test_min_p_drops_unlikely_tokens(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    min_p = 0.5
    p = SamplingParams(temperature=1.0, min_p=min_p, max_tokens=6, ignore_eos=True, logprobs=1)
    outs = gen(llm, [PROMPT, "Hello world!", "A paged KV cache"] * 8, p)
    for out in outs:
        for tok, entry in zip(out.token_ids, out.logprobs):
            assert entry[tok] >= math.log(min_p) + max(entry.values()) - 1e-5


# ---- penalties -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "penalty", [dict(repetition_penalty=2.0), dict(presence_penalty=2.0), dict(frequency_penalty=2.0)]
)
def test_penalties_change_greedy_output(tiny_llama_dir, penalty):
    llm = make_llm(tiny_llama_dir)
    base = greedy_ids(llm, n=32)
    got = gen(llm, PROMPT, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, **penalty))[0]
    assert len(got.token_ids) == 32
    assert got.token_ids != base


def test_large_frequency_penalty_reduces_repetition(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    prompts = [PROMPT, "Hello world!", "A paged KV cache", "Continuous batching"]
    base = gen(llm, prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    pen = gen(
        llm, prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, frequency_penalty=2.0)
    )

    def repeats(ids):
        return len(ids) - len(set(ids))

    assert sum(repeats(o.token_ids) for o in pen) < sum(repeats(o.token_ids) for o in base)
    assert all(repeats(p.token_ids) <= repeats(b.token_ids) for p, b in zip(pen, base))


# ---- logprobs ------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [0, 1, 5])
def test_logprobs_shape_and_greedy_choice(tiny_llama_dir, k):
    llm = make_llm(tiny_llama_dir)
    out = gen(llm, PROMPT, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=k))[0]
    assert len(out.logprobs) == len(out.token_ids) == 10
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert tok in entry
        assert len(entry) == max(k, 1)  # greedy: the chosen token is the best alternative
        assert all(v <= 0 for v in entry.values())
        assert entry[tok] == max(entry.values())


def test_sampled_logprobs_contain_chosen_token(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    k = 4
    outs = gen(llm, [PROMPT] * 6, SamplingParams(temperature=1.5, max_tokens=8, ignore_eos=True, logprobs=k))
    for out in outs:
        for tok, entry in zip(out.token_ids, out.logprobs):
            assert tok in entry and entry[tok] <= 0
            assert len(entry) in (k, k + 1)
            best = sorted(entry.values(), reverse=True)[:k]
            assert all(entry[tok] <= b + 1e-6 for b in best[:1])
    assert gen(llm, PROMPT, SamplingParams(max_tokens=3))[0].logprobs is None


def test_decode_logprobs_agree_with_prompt_logprobs(tiny_llama_dir):
    """The logprob of a generated token equals that token's prompt logprob when the same
    sequence is fed back as a prompt (decode path vs prefill path)."""
    llm = make_llm(tiny_llama_dir)
    prompt = llm.llm_engine.tokenizer.encode(PROMPT)
    out = gen(llm, [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0))[0]
    full = llm.generate(
        [prompt + out.token_ids],
        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
        use_tqdm=False,
    )[0]
    assert len(full.prompt_logprobs) == len(prompt) + 8 and full.prompt_logprobs[0] is None
    for j, tok in enumerate(out.token_ids):
        assert abs(full.prompt_logprobs[len(prompt) + j][tok] - out.logprobs[j][tok]) < 1e-3


# ---- length, stop token ids, min_tokens, logit bias ----------------------------------------------
@pytest.mark.parametrize("max_tokens", [1, 7, 30])
def test_ignore_eos_and_max_tokens_give_exact_length(tiny_llama_dir, max_tokens):
    llm = make_llm(tiny_llama_dir)
    outs = gen(
        llm, [PROMPT, "Hello"], SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    )
    for out in outs:
        assert len(out.token_ids) == max_tokens
        assert out.finish_reason == "length" and out.stop_reason is None


def test_ignore_eos_keeps_generating_through_eos(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    p = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logit_bias={EOS: 100.0})
    out = gen(llm, PROMPT, p)[0]
    assert out.token_ids == [EOS] * 7 and out.finish_reason == "length"


def test_stop_token_id_ends_with_stop_reason(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    base = greedy_ids(llm, n=16)
    j = next(i for i in range(2, 16) if base[i] not in base[:i])
    unused = next(t for t in range(3, VOCAB) if t not in base)
    out = gen(llm, PROMPT, SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[unused, base[j]]))[0]
    assert out.token_ids == base[: j + 1]
    assert out.finish_reason == "stop" and out.stop_reason == base[j]


def test_min_tokens_defers_eos(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    # A +100 bias makes EOS the argmax everywhere; min_tokens must still hold it back.
    p = SamplingParams(temperature=0, max_tokens=12, min_tokens=5, logit_bias={EOS: 100.0})
    out = gen(llm, PROMPT, p)[0]
    assert len(out.token_ids) == 6
    assert EOS not in out.token_ids[:5] and out.token_ids[5] == EOS
    assert out.finish_reason == "stop" and out.stop_reason is None


def test_min_tokens_overrides_stop_token_ids(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    base = greedy_ids(llm, n=16)
    stop = base[1]
    early = gen(llm, PROMPT, SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop]))[0]
    assert len(early.token_ids) <= 2 and early.finish_reason == "stop"
    p = SamplingParams(temperature=0, max_tokens=16, min_tokens=6, stop_token_ids=[stop], ignore_eos=True)
    out = gen(llm, PROMPT, p)[0]
    assert len(out.token_ids) >= 6
    assert stop not in out.token_ids[:6]


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_logit_bias_forces_token(tiny_llama_dir, temperature):
    llm = make_llm(tiny_llama_dir)
    target = 123
    assert target not in greedy_ids(llm, n=8)
    p = SamplingParams(temperature=temperature, max_tokens=8, ignore_eos=True, logit_bias={target: 100.0})
    assert gen(llm, PROMPT, p)[0].token_ids == [target] * 8


def test_a_row_whose_masks_leave_nothing_is_sampled_as_no_token():
    """allowed_token_ids (or bad_words) that remove every token a grammar's bitmask left: the
    all -inf row's argmax was token 0, which the grammar then refused; such a row, and a verified
    position of one, is NO_TOKEN (no logprobs), which the scheduler ends with the client's error."""
    from types import SimpleNamespace

    import torch

    from kvserve.model.layers.empty_rows import NO_TOKEN
    from kvserve.model.layers.sampler import Sampler

    def row(params):
        return SimpleNamespace(params=params, prompt_token_ids=[1], output_token_ids=[], eos_token_ids={EOS},
                               stop_token_ids=set(), generator=None, request_id="r")  # fmt: skip

    masked = row(SamplingParams(temperature=0, allowed_token_ids=[3], logprobs=1))
    logits = torch.zeros(2, 8)
    logits[0, 3] = float("-inf")  # what the grammar's bitmask left out
    out = Sampler()(logits, [masked, row(SamplingParams(temperature=0, logprobs=1))])
    assert out.token_ids == [NO_TOKEN, 0] and out.logprobs[0] is None and out.logprobs[1] is not None
    for temperature in (0, 1.0):
        masked.params = SamplingParams(temperature=temperature, allowed_token_ids=[3], logprobs=0)
        logits = torch.zeros(3, 8)
        logits[1, 3] = float("-inf")  # the draft 3 is accepted at position 0; position 1 has nothing
        logits[0, 3] = 50.0
        out = Sampler().verify(logits, masked, [3, 3])
        assert out.token_ids == [3, NO_TOKEN] and out.logprobs[1] is None, (temperature, out)
