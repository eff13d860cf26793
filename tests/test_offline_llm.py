"""The offline `LLM` as a vLLM user calls it: chat options, the tokenizer,
outputs' fields, progress bars and an interrupted generate."""

from __future__ import annotations

import math
import time
from dataclasses import replace

import numpy as np
import pytest
from conftest import load_reference
from tqdm import tqdm

from kvserve import LLM, SamplingParams

_GREEDY_KW = dict(temperature=0, max_tokens=6, ignore_eos=True)
GREEDY = SamplingParams(**_GREEDY_KW)
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(tiny_llama_dir, kv_cache_memory="8MiB", max_model_len=256)


def assert_idle(llm: LLM) -> None:
    e = llm.llm_engine
    assert not e.has_unfinished_requests()
    assert e.kv_cache_manager.num_free_blocks == e.kv_cache_manager.num_blocks


def test_chat_prompt_is_the_rendered_text(llm):
    """vLLM's chat outputs carry the templated prompt; ours had prompt=None."""
    out = llm.chat(HELLO, GREEDY, use_tqdm=False)[0]
    assert out.prompt == "<s>user: Hello</s><s>assistant:"
    assert out.prompt_token_ids == llm.tokenizer.encode(out.prompt, add_special_tokens=False)


def test_chat_template_and_kwargs(llm):
    """chat_template / chat_template_kwargs / tools were a TypeError (no such parameter)."""
    template = "{{ greeting }} {% for m in messages %}{{ m['content'] }}{% endfor %}"
    outs = llm.chat(
        [HELLO, [{"role": "user", "content": "Bye"}]], GREEDY, use_tqdm=False,
        chat_template=template, chat_template_kwargs={"greeting": "Hi"},
    )  # fmt: skip
    assert [o.prompt for o in outs] == ["Hi Hello", "Hi Bye"]
    alone = llm.generate(llm.tokenizer.encode("Hi Hello", add_special_tokens=False), GREEDY, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    tools = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]
    named = "{% for t in tools %}{{ t.function.name }}{% endfor %}: {{ messages[0]['content'] }}"
    out = llm.chat(HELLO, GREEDY, use_tqdm=False, chat_template=named, tools=tools)[0]
    assert out.prompt == "now: Hello"


def test_chat_tool_call_arguments_reach_the_template_as_objects(llm):
    """OpenAI's assistant tool_calls carry `arguments` as a JSON string; vLLM's LLM.chat (and our
    server) hands the template an object, ours handed the string, so `arguments | tojson` rendered
    it quoted and escaped twice. Empty arguments are {}; invalid JSON is refused naming the call."""
    template = (
        "{% for m in messages %}{{ m.role }}:{% for t in m.tool_calls or [] %}"
        "[{{ t.function.name }} {{ t.function.arguments | tojson }}]{% endfor %};{% endfor %}"
    )
    calls = [
        {"id": "a", "type": "function", "function": {"name": "get", "arguments": '{"city": "Paris"}'}},
        {"id": "b", "type": "function", "function": {"name": "now", "arguments": ""}},
    ]
    conversation = HELLO + [{"role": "assistant", "content": None, "tool_calls": calls}]
    kw = dict(use_tqdm=False, chat_template=template, add_generation_prompt=False)
    out = llm.chat(conversation, GREEDY, **kw)[0]
    assert out.prompt == 'user:;assistant:[get {"city": "Paris"}][now {}];'
    assert calls[0]["function"]["arguments"] == '{"city": "Paris"}'  # the caller's messages untouched
    calls[0]["function"]["arguments"] = "{city"
    with pytest.raises(
        ValueError, match=r"^messages\[1\]\.tool_calls\[0\]\.function\.arguments: not valid JSON"
    ):
        llm.chat(conversation, GREEDY, **kw)
    assert_idle(llm)


def test_chat_continue_final_message(llm):
    """The reply extends the assistant's last message: no end of turn, no new generation prompt."""
    conversation = HELLO + [{"role": "assistant", "content": "Sure, the"}]
    out = llm.chat(
        conversation, GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True
    )[0]
    assert out.prompt == "<s>user: Hello</s><s>assistant: Sure, the"


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"continue_final_message": True}, "continue_final_message.*add_generation_prompt"),
        (
            {"continue_final_message": True, "add_generation_prompt": False},
            "continue_final_message.*assistant",
        ),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs: tokenize"),
        ({"chat_template": "{{ messages[0]['content'] "}, "messages: the chat template"),
    ],
)
def test_chat_bad_options_name_the_field(llm, kwargs, words):
    with pytest.raises(ValueError, match=words):
        llm.chat(HELLO, GREEDY, use_tqdm=False, **kwargs)
    assert_idle(llm)


def test_cumulative_logprob(llm):
    """vLLM's CompletionOutput.cumulative_logprob: the sampled tokens' logprobs summed (it was
    missing: an AttributeError); None without logprobs."""
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True, logprobs=2, n=2)
    for c in llm.generate("a paged cache", params, use_tqdm=False)[0].outputs:
        want = sum(lp[t] for t, lp in zip(c.token_ids, c.logprobs))
        assert c.cumulative_logprob is not None and math.isclose(c.cumulative_logprob, want, rel_tol=1e-9)
    plain = llm.generate("a paged cache", GREEDY, use_tqdm=False)[0].outputs[0]
    assert plain.cumulative_logprob is None


def test_get_tokenizer(llm):
    tok = llm.get_tokenizer()
    assert tok.apply_chat_template(HELLO, tokenize=False, add_generation_prompt=True) == (
        "<s>user: Hello</s><s>assistant:"
    )


class _Bar(tqdm):
    """A progress bar the caller gave (vLLM's use_tqdm may be a tqdm class)."""

    made = 0
    stop_after: int | None = None

    def __init__(self, *args, **kwargs) -> None:
        type(self).made += 1
        self.done = 0  # a disabled tqdm does not count
        super().__init__(*args, **{**kwargs, "disable": True})

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.stop_after is not None and self.done > self.stop_after:
            raise KeyboardInterrupt  # what Ctrl-C in a notebook raises mid-generate
        super().update(n)


def test_use_tqdm_takes_a_bar_class(llm):
    before = _Bar.made
    llm.generate(["a", "b"], GREEDY, use_tqdm=_Bar)
    assert _Bar.made == before + 1


def test_interrupted_generate_leaves_nothing_running(llm):
    """Ctrl-C mid-generate left the call's other requests running in the engine: they held KV
    blocks, and the next generate ran them too, counting their finishes as its own."""
    prompts = ["a", "b", "c", "d"]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    short = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    params = [short] + [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * 3

    class Interrupt(_Bar):
        stop_after = 0  # at the short request's finish

    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, params, use_tqdm=Interrupt)
    assert_idle(llm)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == want


def test_generate_counts_only_its_own_finishes(llm):
    """A request another caller queued on the engine finished first and was counted as one of
    this call's: generate stopped early and failed with a KeyError."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (2, 6)]
    want = llm.generate(["a", "b"], params, use_tqdm=False)
    llm.llm_engine.add_request("other", "c", SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    got = llm.generate(["a", "b"], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert_idle(llm)


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    """vLLM's truncate_prompt_tokens was a TypeError (no such field); k keeps the prompt's last k
    tokens, -1 the last max_model_len."""
    ids = list(range(5, 60))
    cut = llm.generate(ids, SamplingParams(**_GREEDY_KW, truncate_prompt_tokens=10), use_tqdm=False)[0]
    alone = llm.generate(ids[-10:], GREEDY, use_tqdm=False)[0]
    assert cut.prompt_token_ids == ids[-10:]
    assert cut.outputs[0].token_ids == alone.outputs[0].token_ids
    whole = llm.generate(ids, SamplingParams(**_GREEDY_KW, truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert whole.prompt_token_ids == ids


def test_truncate_prompt_tokens_to_the_whole_context_generates(llm, tiny_llama_dir):
    """vLLM keeps the last max_model_len tokens for -1 and generates up to the context's end (one
    token after a whole context, finish_reason "length"); ours refused the prompt it had just cut
    ("leave no room to generate"), and a cut prompt with max_tokens past the context too."""
    import torch

    ids = [5 + i % 400 for i in range(300)]
    params = SamplingParams(temperature=0, max_tokens=6, truncate_prompt_tokens=-1)
    out = llm.generate(ids, params, use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-256:]
    c = out.outputs[0]
    with torch.no_grad():
        want = int(load_reference(tiny_llama_dir)(torch.tensor([ids[-256:]])).logits[0, -1].argmax())
    assert (c.token_ids, c.finish_reason) == ([want], "length")
    near = llm.generate(ids, replace(params, truncate_prompt_tokens=250), use_tqdm=False)[0].outputs[0]
    assert (len(near.token_ids), near.finish_reason) == (6, "length")
    cut = llm.generate(ids, replace(params, truncate_prompt_tokens=253), use_tqdm=False)[0].outputs[0]
    assert (len(cut.token_ids), cut.finish_reason) == (3, "length")  # to the context's end
    assert_idle(llm)


@pytest.mark.parametrize("keep", [0, -2, 257, 2.5])
def test_truncate_prompt_tokens_bad_values_name_it(llm, keep):
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.generate("a", SamplingParams(**_GREEDY_KW, truncate_prompt_tokens=keep), use_tqdm=False)
    assert_idle(llm)


def test_chat_content_parts_are_text(llm):
    """OpenAI's content parts were rendered as the list's Python repr; text parts are joined by
    a newline as vLLM's LLM.chat joins them (they were joined with "": "Hel" + "lo" read
    "Hello"), and a part that is not text is refused, naming it."""
    parts = [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]
    out = llm.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False)[0]
    assert out.prompt == "<s>user: Hel\nlo</s><s>assistant:"
    one = llm.chat([{"role": "user", "content": parts[:1]}], GREEDY, use_tqdm=False)[0]
    assert one.prompt == "<s>user: Hel</s><s>assistant:"
    image = [{"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]: type 'image_url'"):
        llm.chat([{"role": "user", "content": image}], GREEDY, use_tqdm=False)
    assert_idle(llm)


def test_pooling_takes_one_sample(llm):
    """pooling with n=2 computed the same embedding twice and returned two empty completions."""
    with pytest.raises(ValueError, match="n: must be 1 with pooling"):
        SamplingParams(pooling="mean", n=2)
    out = llm.generate("a", SamplingParams(pooling="mean"), use_tqdm=False)[0]
    assert out.embedding and len(out.outputs) == 1


def test_priority_needs_the_priority_policy(llm):
    """As vLLM's: priorities under first-come-first-served were silently ignored."""
    with pytest.raises(ValueError, match='priority: needs scheduling_policy="priority"'):
        llm.generate(["a", "b"], GREEDY, priority=[1, 0], use_tqdm=False)
    assert_idle(llm)
    assert len(llm.generate(["a", "b"], GREEDY, priority=[0, 0], use_tqdm=False)) == 2


def test_min_tokens_skips_stop_strings_in_their_text(llm):
    """As vLLM: a stop string counts only in the text after the first min_tokens tokens (stop
    token ids are held back as long); one in the min_tokens-th token's text ended the request."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ids = llm.generate("a paged cache", params, use_tqdm=False)[0].outputs[0].token_ids
    decode = llm.tokenizer.decode

    def piece(k: int) -> str:  # the text token k adds
        return decode(ids[: k + 1])[len(decode(ids[:k])) :]

    # The first token whose text is new (not in the text before it): a stop string only it ends.
    k = next(k for k in range(1, len(ids)) if piece(k).strip() and piece(k) not in decode(ids[:k]))
    stopped = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[piece(k)], min_tokens=k)
    c = llm.generate("a paged cache", stopped, use_tqdm=False)[0].outputs[0]
    assert (c.token_ids, c.finish_reason, c.text) == (ids[: k + 1], "stop", decode(ids[:k]))
    held = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[piece(k)], min_tokens=k + 1)
    c = llm.generate("a paged cache", held, use_tqdm=False)[0].outputs[0]
    assert len(c.token_ids) > k + 1 and c.text.startswith(decode(ids[: k + 1]))


def test_numpy_token_ids(llm):
    """Token ids from numpy (an array, or a list of its integers) are a prompt as a list is: an
    array raised "truth value of an array is ambiguous", a list of numpy ints "token ids must be
    integers"."""
    ids = [5, 17, 42, 7]
    want = llm.generate(ids, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    for prompt in (np.array(ids), list(np.array(ids)), {"prompt_token_ids": np.array(ids)}):
        out = llm.generate(prompt, GREEDY, use_tqdm=False)
        assert len(out) == 1 and out[0].outputs[0].token_ids == want
        assert all(type(t) is int for t in out[0].prompt_token_ids)
    two = llm.generate(np.array([ids, ids]), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in two] == [want, want]
    with pytest.raises(ValueError, match="prompt 0: prompt: must be text or a list of token ids, got float"):
        llm.generate([3.5], GREEDY, use_tqdm=False)
    assert_idle(llm)


def test_embed(llm):
    """vLLM's LLM.embed was missing: one L2-normalized vector per prompt, the pooled state the
    engine computes, as out.outputs.embedding."""
    outs = llm.embed(["a paged cache", [5, 17, 42]], use_tqdm=False)
    assert [o.prompt_token_ids for o in outs][1] == [5, 17, 42]
    raw = llm.generate("a paged cache", SamplingParams(pooling="last"), use_tqdm=False)[0].embedding
    norm = math.sqrt(sum(x * x for x in raw))
    got = outs[0].outputs.embedding
    assert math.isclose(math.sqrt(sum(x * x for x in got)), 1.0, rel_tol=1e-6)
    assert all(math.isclose(g, r / norm, rel_tol=1e-5, abs_tol=1e-7) for g, r in zip(got, raw))
    mean = llm.embed("a paged cache", use_tqdm=False, pooling="mean")[0].outputs.embedding
    assert len(mean) == len(got) and mean != got
    cut = llm.embed(list(range(5, 60)), use_tqdm=False, truncate_prompt_tokens=3)[0]
    assert cut.prompt_token_ids == [57, 58, 59]
    with pytest.raises(ValueError, match="pooling"):
        llm.embed("a", use_tqdm=False, pooling="max")


def _full_rank(entry: dict, token: int) -> int:
    return 1 + sum(v > entry[token] for v in entry.values())


def test_logprobs_are_vllm_logprob_objects(llm):
    """vLLM's values are `Logprob`s (`.logprob`, `.rank`, `.decoded_token`); they were bare
    floats, so `lp[tok].logprob` raised AttributeError. They still add up as floats."""
    tok = llm.get_tokenizer()
    vocab = 512  # every token's logprob: the exact rank of each is known
    kw = dict(temperature=1.0, seed=7, max_tokens=5, ignore_eos=True)
    full = llm.generate(
        "a paged cache", SamplingParams(**kw, logprobs=vocab, prompt_logprobs=vocab), use_tqdm=False
    )
    some = llm.generate("a paged cache", SamplingParams(**kw, logprobs=2, prompt_logprobs=1), use_tqdm=False)
    full, some = full[0], some[0]
    c = some.outputs[0]
    assert c.token_ids == full.outputs[0].token_ids
    assert some.prompt_logprobs[0] is None
    pairs = list(zip(full.prompt_logprobs[1:], some.prompt_logprobs[1:], [1] * 99)) + list(
        zip(full.outputs[0].logprobs, c.logprobs, [2] * 99)
    )
    sampled_at = [(t,) for t in some.prompt_token_ids[1:]] + [(t,) for t in c.token_ids]  # rank known
    for (whole, entry, k), sampled in zip(pairs, sampled_at):
        for t, lp in entry.items():
            assert lp.logprob == float(lp) and type(lp.logprob) is float
            assert lp.decoded_token == tok.decode([t])
            rank = _full_rank(whole, t)
            assert lp.rank == (rank if rank <= k or t in sampled else None), (t, lp, rank)
        assert {lp.rank for lp in entry.values() if lp.rank is not None} >= set(range(1, k + 1))
    assert math.isclose(c.cumulative_logprob, sum(lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)))
    assert "Logprob(logprob=" in repr(c.logprobs[0])


def test_logprobs_minus_one_is_the_whole_vocabulary(llm):
    """vLLM's logprobs=-1 / prompt_logprobs=-1 return every token's logprob; ours refused -1
    ("must be >= 0"). Each entry now holds the whole vocabulary (512 here), ranked, as asking
    for the vocabulary size does."""
    kw = dict(temperature=1.0, seed=5, max_tokens=3, ignore_eos=True)
    every = llm.generate(
        "a paged cache", SamplingParams(**kw, logprobs=-1, prompt_logprobs=-1), use_tqdm=False
    )[0]
    sized = llm.generate(
        "a paged cache", SamplingParams(**kw, logprobs=512, prompt_logprobs=512), use_tqdm=False
    )[0]
    assert every.outputs[0].token_ids == sized.outputs[0].token_ids
    entries = every.prompt_logprobs[1:] + every.outputs[0].logprobs
    assert entries == sized.prompt_logprobs[1:] + sized.outputs[0].logprobs
    ranks = [{t: lp.rank for t, lp in e.items()} for e in entries]
    assert ranks == [
        {t: lp.rank for t, lp in e.items()} for e in sized.prompt_logprobs[1:] + sized.outputs[0].logprobs
    ]
    assert all(len(e) == 512 and None not in {lp.rank for lp in e.values()} for e in entries)
    for bad in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"^{bad}: must be -1 or >= 0"):
            SamplingParams(**{bad: -2})
    assert_idle(llm)


def _reference_ranks(ref, prompt_ids: list[int], token_ids: list[int], eps: float = 1e-4) -> list[range]:
    """Each sampled token's possible ranks from transformers' full-vocabulary log_softmax: 1 +
    the tokens above it, a token within eps of it counted either way (fp32 noise)."""
    import torch

    with torch.no_grad():
        logits = ref(torch.tensor([prompt_ids + token_ids])).logits[0].float()
    rows = logits.log_softmax(-1)[len(prompt_ids) - 1 : -1]
    out = []
    for row, t in zip(rows, token_ids):
        v = row[t]
        out.append(range(1 + int((row > v + eps).sum()), 1 + int((row > v - eps).sum())))  # counts t
    return out


@pytest.mark.parametrize("spec", [{}, {"speculative_method": "ngram", "speculative_ngram_min": 1}])
def test_sampled_token_rank_is_its_vocabulary_rank(tiny_llama_dir, spec):
    """vLLM's sampled token always has its rank; ours was None outside the top-k asked for, so
    always None with logprobs=0 unless it was the argmax. The sampler (and its speculative
    verification) counts it; checked against transformers' full log_softmax."""
    llm = LLM(tiny_llama_dir, kv_cache_memory="8MiB", max_model_len=256, **spec)
    prompt = "a b c a b c a b c a b c" if spec else "a paged cache"
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=24, ignore_eos=True, logprobs=0)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    c = out.outputs[0]
    expected = _reference_ranks(load_reference(tiny_llama_dir), out.prompt_token_ids, c.token_ids)
    ranks = [lp[t].rank for t, lp in zip(c.token_ids, c.logprobs)]
    assert all(r in want for r, want in zip(ranks, expected)), list(zip(ranks, expected))
    assert max(ranks) > 1  # tokens below the argmax were drawn: the case that was None
    if spec:
        assert llm.llm_engine.core.scheduler.spec_stats.num_drafts > 0


def test_numpy_numbers_in_sampling_params(llm):
    """seed=np.int64(3) (a seed drawn with numpy, a value read from an array) failed generate with
    "OverflowError: Python int too large to convert to C long" in the samples' seed arithmetic;
    numpy values are kept as Python's, and sample exactly as those."""
    kw = dict(temperature=np.float32(0.8), max_tokens=np.int64(4), n=np.int64(2), top_k=np.int32(50))
    got = llm.generate("a paged cache", SamplingParams(**kw, seed=np.int64(3)), use_tqdm=False)[0]
    plain = dict(temperature=float(np.float32(0.8)), max_tokens=4, n=2, top_k=50, seed=3)
    want = llm.generate("a paged cache", SamplingParams(**plain), use_tqdm=False)[0]
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    p = SamplingParams(
        seed=np.int64(2**63 - 1), stop_token_ids=[np.int64(7)], logit_bias={np.int64(5): np.float64(1)}
    )
    assert type(p.seed) is int and type(p.stop_token_ids[0]) is int and type(next(iter(p.logit_bias))) is int
    assert_idle(llm)


def test_structured_outputs_given_as_a_dict(llm):
    """SamplingParams(structured_outputs={"choice": [...]}) (the server's body shape) failed inside
    generate with "'dict' object has no attribute 'json'"; it is taken as StructuredOutputsParams,
    and a value of another type or an unknown key is a ValueError naming the field."""
    params = SamplingParams(temperature=0, max_tokens=8, structured_outputs={"choice": ["yes", "no"]})
    assert llm.generate("a paged cache", params, use_tqdm=False)[0].outputs[0].text in ("yes", "no")
    for bad in ("yes|no", {"choices": ["yes"]}):
        with pytest.raises(ValueError, match="^structured_outputs: "):
            SamplingParams(structured_outputs=bad)
    assert_idle(llm)


def _reference_prompt_ranks(ref, prompt_ids: list[int], eps: float = 1e-4) -> list[range]:
    """Each prompt token's possible ranks (from the second on) from transformers' full log_softmax."""
    import torch

    with torch.no_grad():
        rows = ref(torch.tensor([prompt_ids])).logits[0].float().log_softmax(-1)[:-1]
    return [
        range(1 + int((row > row[t] + eps).sum()), 1 + int((row > row[t] - eps).sum()))
        for row, t in zip(rows, prompt_ids[1:])
    ]


@pytest.mark.parametrize("k", [0, 2])
def test_prompt_token_rank_is_its_vocabulary_rank(llm, tiny_llama_dir, k):
    """vLLM gives every prompt token its rank in the vocabulary; ours was None for a prompt
    token outside the top-k asked for (always, with prompt_logprobs=0, unless it was the
    argmax). Checked against transformers' full-vocabulary log_softmax."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k)
    out = llm.generate("The quick brown fox jumps over the lazy dog.", params, use_tqdm=False)[0]
    expected = _reference_prompt_ranks(load_reference(tiny_llama_dir), out.prompt_token_ids)
    ranks = [lp[t].rank for t, lp in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])]
    assert all(r in want for r, want in zip(ranks, expected)), list(zip(ranks, expected))
    assert max(ranks) > k + 1  # tokens outside the top-k: the case that was None


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("guided_decoding", {"regex": "a+"}, "guided_decoding: use structured_outputs"),
        ("detokenize", False, "detokenize: False is not supported"),
        ("logits_processors", [print], "logits_processors: not supported"),
        ("best_of", 3, "best_of: not supported offline"),
    ],
)
def test_vllm_only_sampling_fields_name_themselves(field, value, words):
    """vLLM's SamplingParams fields kvserve lacks were a bare TypeError from the dataclass; now a
    ValueError naming the field and why, and at vLLM's default value they change nothing."""
    with pytest.raises(ValueError, match=f"^{words}.*vLLM SamplingParams field"):
        SamplingParams(**{field: value})


def test_vllm_only_sampling_fields_at_their_defaults(llm):
    params = SamplingParams(
        **_GREEDY_KW, bad_words=None, allowed_token_ids=None, detokenize=True, output_kind=2,
        spaces_between_special_tokens=True, logits_processors=[], best_of=None,
    )  # fmt: skip
    assert params == GREEDY
    assert llm.generate("a", params, use_tqdm=False)[0].outputs[0].text == (
        llm.generate("a", GREEDY, use_tqdm=False)[0].outputs[0].text
    )
    with pytest.raises(TypeError, match="no_such_field"):  # not vLLM's either: the dataclass's own error
        SamplingParams(no_such_field=1)


def test_allowed_token_ids_and_bad_words_mask_the_logits(llm):
    """vLLM's allowed_token_ids and bad_words were a ValueError ("not supported"). allowed: only
    those tokens are drawn; bad_words: a word's last token is banned where the output ends with
    its other tokens. Expected tokens from the unmasked greedy run's raw top logprobs."""
    prompt = "The quick brown fox"
    base = llm.generate(prompt, SamplingParams(**_GREEDY_KW, logprobs=3), use_tqdm=False)[0].outputs[0]
    ids = base.token_ids

    def run(**kw) -> list[int]:
        out = llm.generate(prompt, SamplingParams(**_GREEDY_KW, **kw), use_tqdm=False)[0]
        return out.outputs[0].token_ids

    def runner_up(i: int) -> int:
        return max((t for t in base.logprobs[i] if t != ids[i]), key=lambda t: base.logprobs[i][t])

    assert run(allowed_token_ids=[*ids, 5]) == ids  # the greedy tokens allowed: nothing changes
    assert run(allowed_token_ids=[ids[1]]) == [ids[1]] * len(ids)
    tok = llm.tokenizer

    # a two-token word of the output, spelled as it tokenizes (alone or after a space)
    def spellings(word: str) -> list[list[int]]:
        return [tok.encode(w, add_special_tokens=False) for w in (word.lstrip(), " " + word.lstrip())]

    i = next(i for i in range(1, len(ids) - 1) if ids[i : i + 2] in spellings(tok.decode(ids[i : i + 2])))
    out = run(bad_words=[tok.decode(ids[i : i + 2])])
    assert out[: i + 1] == ids[: i + 1] and out[i + 1] == runner_up(i + 1), (ids, out)
    out = run(bad_words=[tok.decode([ids[0]])])  # one token: never drawn
    assert out[0] == runner_up(0) and ids[0] not in out, (ids, out)
    with pytest.raises(ValueError, match=r"allowed_token_ids: token ids out of range \[0, 512\): \[512\]"):
        run(allowed_token_ids=[3, 512])
    with pytest.raises(ValueError, match=r"bad_words: token ids out of range \[0, 512\): \[600\]"):
        run(bad_words_token_ids=[[3, 600]])  # set directly: no index error inside a step
    for kw, words in (
        ({"allowed_token_ids": []}, "allowed_token_ids: must not be empty"),
        ({"bad_words": [" "]}, "bad_words: must be a list of non-blank"),
        ({"bad_words": "dog"}, "bad_words: must be a list"),
        ({"bad_words_token_ids": [[]]}, "bad_words: token ids must be non-empty lists"),
        ({"bad_words": ["dog"], "n": 2, "use_beam_search": True}, "bad_words: is not supported"),
    ):
        with pytest.raises(ValueError, match=words):
            SamplingParams(**{**_GREEDY_KW, **kw})


def test_vllm_script_helpers(llm):
    """vLLM's own examples call llm.get_default_sampling_params(), SamplingParams.clone() and
    CompletionOutput.finished(): each was an AttributeError."""
    params = llm.get_default_sampling_params()
    assert params == SamplingParams() and params is not llm.get_default_sampling_params()
    params.max_tokens = 4  # edited in place, as vLLM's example does
    copy = params.clone()
    copy.stop = ["x"]
    assert params.stop is None and copy.max_tokens == 4
    out = llm.generate("a", params, use_tqdm=False)[0].outputs[0]
    assert out.finished() and len(out.token_ids) <= 4


@pytest.mark.parametrize(
    "given, words",
    [
        (
            {"max_tokens": 3},
            r"sampling_params: expected SamplingParams or a list of them, got dict \(SamplingParams",
        ),
        ([{"max_tokens": 3}], r"sampling_params\[0\]: expected SamplingParams, got dict"),
    ],
)
def test_sampling_params_of_another_type_name_it(llm, given, words):
    """A dict was read as the list of its keys: "'str' object has no attribute 'n'"."""
    with pytest.raises(TypeError, match=words):
        llm.generate("a", given, use_tqdm=False)
    assert_idle(llm)


class _Clock(tqdm):
    """Records when each request's finish is counted."""

    def __init__(self, *args, **kwargs) -> None:
        self.times: list[float] = []
        _Clock.last = self
        super().__init__(*args, **{**kwargs, "disable": True})

    def update(self, n: int = 1) -> None:
        self.times.append(time.monotonic())
        super().update(n)


def test_n_samples_finish_with_the_last(llm):
    """metrics of n samples were the first sample's: finished_time (and e2e_latency) before the
    longer samples had ended."""
    params = SamplingParams(n=4, seed=2, max_tokens=40, stop_token_ids=list(range(100, 140)))
    out = llm.generate([[1, *range(10, 60)]], params, use_tqdm=_Clock)[0]
    lengths = sorted(len(c.token_ids) for c in out.outputs)
    shorter = sum(n < lengths[-1] for n in lengths)  # counted before the longest's last step ran
    assert shorter >= 1
    times = _Clock.last.times
    assert times[shorter - 1] < out.metrics.finished_time <= times[-1]
    assert out.metrics.e2e_latency == out.metrics.finished_time - out.metrics.arrival_time


def test_chat_takes_vllms_parameters(llm):
    """vLLM's lora_request and chat_template_content_format were a TypeError (and a positional
    lora_request was read as generate's priority); "openai" hands the parts to the template."""
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    loop = "{% for m in messages %}{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}{% endfor %}"
    msgs = [{"role": "user", "content": parts}]
    out = llm.chat(msgs, GREEDY, False, None, loop, "openai", add_generation_prompt=False)[0]
    assert out.prompt == "[a][b]"
    assert llm.chat(msgs, GREEDY, use_tqdm=False, chat_template_content_format="string")[0].prompt == (
        "<s>user: a\nb</s><s>assistant:"
    )
    with pytest.raises(ValueError, match="chat_template_content_format: must be auto, string or openai"):
        llm.chat(msgs, GREEDY, use_tqdm=False, chat_template_content_format="list")
    for call in (
        lambda: llm.chat(HELLO, GREEDY, False, object()),
        lambda: llm.generate("a", GREEDY, False, object()),
    ):
        with pytest.raises(ValueError, match="lora_request: LoRA adapters are not supported"):
            call()
    assert len(llm.generate(["a", "b"], GREEDY, False, None, [0, 0])) == 2  # vLLM's positions
    assert_idle(llm)


def test_vllms_llm_options(tiny_llama_dir):
    """vLLM scripts pass trust_remote_code=True, dtype="auto", tokenizer=<the model>, swap_space,
    disable_log_stats: each was a TypeError (dtype a ValueError) before the model loaded."""
    llm = LLM(
        tiny_llama_dir, kv_cache_memory="4MiB", max_model_len=64, trust_remote_code=True, dtype="auto",
        tokenizer=tiny_llama_dir, tokenizer_mode="auto", swap_space=4, disable_log_stats=True,
    )  # fmt: skip
    assert llm.llm_engine.config.dtype == "float32"
    assert llm.generate("a", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    for kw, words in [
        (dict(revision="main"), "revision: 'main' is not supported"),
        (dict(tokenizer_mode="slow"), "tokenizer_mode: 'slow' is not supported"),
    ]:
        with pytest.raises(ValueError, match=words):
            LLM(tiny_llama_dir, **kw)
    with pytest.raises(TypeError, match="^LLM.. got an unexpected keyword argument 'no_such_option'"):
        LLM(tiny_llama_dir, no_such_option=1)  # neither kvserve's nor vLLM's


def test_more_vllm_llm_options(tiny_llama_dir):
    """enable_chunked_prefill=True, load_format="auto", download_dir, max_logprobs,
    compilation_config, max_seq_len_to_capture (common in vLLM scripts) were a TypeError naming
    EngineConfig; those that change nothing here are taken, a value kvserve cannot honour named."""
    llm = LLM(
        tiny_llama_dir, kv_cache_memory="4MiB", max_model_len=64, enable_chunked_prefill=True,
        load_format="auto", download_dir="/tmp", max_logprobs=20, compilation_config=3,
        max_seq_len_to_capture=8192,
    )  # fmt: skip
    assert llm.generate("a", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    for kw, words in [
        (dict(enable_chunked_prefill=False), "^enable_chunked_prefill: False is not supported; prompts are"),
        (dict(load_format="pt"), "^load_format: 'pt' is not supported"),
    ]:
        with pytest.raises(ValueError, match=words):
            LLM(tiny_llama_dir, **kw)
