"""IncrementalDetokenizer: token-by-token text equals the full decode (multi-byte UTF-8 too),
stop strings across token boundaries, held-back streaming deltas; and stop strings end to end."""

from __future__ import annotations

import pytest
import transformers

from kvserve import LLM, SamplingParams
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.tokenizer import Tokenizer

FOX = "The quick brown fox jumps over the lazy dog."
UNICODE_TEXTS = [
    "héllo wörld — naïve café ✓ 日本語 🙂",
    "日本 🙂🙂 éé ñ 中文 🎉",  # mostly unseen by the tiny BPE: split into single bytes
    "a🙂b日c\u00e9\u0301d — ✓✓✓",
    FOX,
]


@pytest.fixture(scope="module")
def tok(tiny_llama_dir) -> Tokenizer:
    return Tokenizer(transformers.AutoTokenizer.from_pretrained(tiny_llama_dir))


def ids_of(tok: Tokenizer, text: str) -> list[int]:
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    return ids


def stream(tok: Tokenizer, ids: list[int], params: SamplingParams, chunks: list[int] | None = None):
    """Feed ids as the engine does (growing output lists); returns (detok, stop, deltas)."""
    d = IncrementalDetokenizer(tok, params)
    deltas: list[str] = []
    stop = None
    n = 0
    sizes = iter(chunks or [])
    while n < len(ids):
        n = min(len(ids), n + next(sizes, 1))
        stop = d.update(ids[:n])
        finished = stop is not None or n == len(ids)
        deltas.append(d.release(finished))
        if stop is not None:
            break
    return d, stop, deltas


# ---- text equals the full decode -------------------------------------------------------------------
@pytest.mark.parametrize("text", UNICODE_TEXTS)
def test_incremental_text_equals_full_decode(tok, text):
    ids = ids_of(tok, text)
    d = IncrementalDetokenizer(tok, SamplingParams())
    for i in range(1, len(ids) + 1):
        assert d.update(ids[:i]) is None
        assert text.startswith(d.text), f"after {i} tokens: {d.text!r} is not a prefix of {text!r}"
        assert "\ufffd" not in d.text, "an incomplete UTF-8 character leaked into the text"
    assert d.text == text == tok.decode(ids)
    assert d.num_tokens == len(ids)


@pytest.mark.parametrize("text", UNICODE_TEXTS)
def test_chunked_updates_give_the_same_text(tok, text):
    ids = ids_of(tok, text)
    d, stop, deltas = stream(tok, ids, SamplingParams(), chunks=[3, 1, 2, 5, 1, 4] * 10)
    assert stop is None
    assert d.text == text == "".join(deltas)


def test_multibyte_pieces_are_split_across_tokens(tok):
    """Guard that the texts above really exercise partial UTF-8 characters."""
    ids = ids_of(tok, UNICODE_TEXTS[1])
    assert any("\ufffd" in tok.decode([i]) for i in ids)


def test_skip_special_tokens(tok):
    ids = ids_of(tok, "Hello world") + [tok.eos_token_id]
    d, _, _ = stream(tok, ids, SamplingParams())
    assert d.text == "Hello world"
    d, _, _ = stream(tok, ids, SamplingParams(skip_special_tokens=False))
    assert d.text == "Hello world</s>"


# ---- stop strings ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text,stop",
    [(FOX, "own fo"), (FOX, " fox"), (FOX, "dog."), (UNICODE_TEXTS[0], "本語 "), (UNICODE_TEXTS[1], "🙂 é")],
)
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundaries(tok, text, stop, include):
    ids = ids_of(tok, text)
    if stop != " fox":  # the others really span several tokens
        assert not any(stop in tok.decode([i]) for i in ids)
    i = text.index(stop)
    params = SamplingParams(stop=[stop], include_stop_str_in_output=include)
    d, found, deltas = stream(tok, ids, params)
    assert found == stop
    expected = text[: i + len(stop)] if include else text[:i]
    assert d.text == expected
    assert "".join(deltas) == expected
    # It was found as soon as the token that completes it arrived, not later (a token that ends
    # in an incomplete UTF-8 character is held back whole until the character completes).
    n_needed = next(
        n
        for n in range(1, len(ids) + 1)
        if stop in tok.decode(ids[:n]) and not tok.decode(ids[:n]).endswith("\ufffd")
    )
    assert d.num_tokens == n_needed


@pytest.mark.parametrize("stop", ["own fo", "dog.", "over t", "n f"])
@pytest.mark.parametrize("include", [False, True])
def test_tokens_are_released_with_their_text(tok, stop, include):
    """A token goes out only once its text has (not while it may start a stop string), and at
    the end exactly the tokens whose text starts before the cut: what a whole answer reports."""
    ids = ids_of(tok, FOX)
    d = IncrementalDetokenizer(tok, SamplingParams(stop=[stop], include_stop_str_in_output=include))
    shown, released = "", []
    for n in range(1, len(ids) + 1):
        found = d.update(ids[:n])
        shown += d.release(found is not None)
        a, b = d.release_tokens(found is not None)
        assert a == len(released)
        released += ids[a:b]
        if found is None:
            assert shown.startswith(tok.decode(released)), (shown, released)
        else:
            break
    assert shown == d.text
    content = next(m for m in range(len(ids) + 1) if len(tok.decode(ids[:m])) >= len(d.text))
    assert released == ids[:content], (tok.decode(released), d.text)


@pytest.mark.parametrize("chunks", [None, [2, 3, 1, 4, 2, 5, 1, 1, 3], [100]])
def test_streamed_deltas_never_show_the_stop_string(tok, chunks):
    stop = "over the"
    ids = ids_of(tok, FOX)
    d, found, deltas = stream(tok, ids, SamplingParams(stop=[stop, "xyz"]), chunks)
    assert found == stop
    assert "".join(deltas) == d.text == FOX[: FOX.index(stop)]
    shown = ""
    for delta in deltas:
        shown += delta
        assert stop not in shown
        assert FOX.startswith(shown)
    # Hold-back is bounded: before the end, at most len(longest stop) - 1 characters are withheld.
    d2 = IncrementalDetokenizer(tok, SamplingParams(stop=["never here"]))
    released = ""
    for i in range(1, len(ids) + 1):
        d2.update(ids[:i])
        released += d2.release(False)
        assert len(d2.text) - len(released) <= len("never here") - 1
    released += d2.release(True)
    assert released == FOX


def test_no_stop_strings_stream_everything_at_once(tok):
    ids = ids_of(tok, FOX)
    d = IncrementalDetokenizer(tok, SamplingParams())
    shown = ""
    for i in range(1, len(ids) + 1):
        d.update(ids[:i])
        shown += d.release(False)
        assert shown == d.text == tok.decode(ids[:i])


@pytest.mark.parametrize("chunks", [None, [100]])
def test_earliest_stop_string_wins(tok, chunks):
    # "quick brown" starts first although it is listed last and completes after "The quick".
    stops = ["lazy", "fox", "quick brown"]
    ids = ids_of(tok, FOX)
    d, found, deltas = stream(tok, ids, SamplingParams(stop=stops), chunks)
    assert found == "quick brown" and d.text == "The "
    # Same start, overlapping stops: the one that completes first ends the text.
    d, found, _ = stream(tok, ids, SamplingParams(stop=["brown fox jumps", "brown"]), chunks)
    assert d.text == "The quick " and found in ("brown", "brown fox jumps")


# ---- end to end through LLM.generate ---------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(tiny_llama_dir, kv_cache_memory="64MiB")


def _stop_candidate(text: str) -> tuple[int, str]:
    for i in range(4, len(text) - 3):
        sub = text[i : i + 3]
        if "\ufffd" not in sub and sub.strip() and text.find(sub) == i:
            return i, sub
    raise AssertionError(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("prompt", ["The quick brown fox", "Hello world!", "A paged KV cache"])
def test_generate_cuts_text_at_stop_string(llm, prompt):
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    full = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0]
    i, stop = _stop_candidate(full.text)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=32, stop=stop), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.text == full.text[:i]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert full.token_ids[: len(c.token_ids)] == c.token_ids and len(c.token_ids) < 32
    assert stop in llm.tokenizer.decode(c.token_ids) or "\ufffd" in llm.tokenizer.decode(c.token_ids)

    incl = SamplingParams(temperature=0, max_tokens=32, stop=[stop], include_stop_str_in_output=True)
    c2 = llm.generate(prompt, incl, use_tqdm=False)[0].outputs[0]
    assert c2.text == full.text[: i + len(stop)] and c2.stop_reason == stop
    e = llm.llm_engine
    assert e.kv_cache_manager.num_free_blocks == e.kv_cache_manager.num_blocks


def test_engine_stream_deltas_with_stop_string(llm):
    prompt = "The quick brown fox"
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    i, stop = _stop_candidate(full[0].outputs[0].text)
    e = llm.llm_engine
    e.add_request("s", prompt, SamplingParams(temperature=0, max_tokens=32, stop=[stop]))
    shown, final = "", None
    while e.has_unfinished_requests():
        for out in e.step():
            shown += out.outputs[0].delta_text
            assert stop not in shown
            if out.finished:
                final = out.outputs[0]
    assert final is not None and final.finish_reason == "stop" and final.stop_reason == stop
    assert shown == final.text == full[0].outputs[0].text[:i]


# ---- the end of a request while the stream holds part of a character ------------------------------
def _partial_token(tok: Tokenizer) -> int:
    """A token that is only the first bytes of a character: alone it decodes to U+FFFD."""
    return next(i for i in ids_of(tok, "日本") if tok.decode([i]) == "\ufffd")


@pytest.mark.parametrize("then", ["eos", "stop_token", "length", "abort"])
def test_held_bytes_end_the_text_as_the_full_decode_shows_them(tok, then):
    """A request ending right after a token that starts a character (then an EOS or a stop token
    id, or at max tokens, or aborted) ends with what transformers' decode shows for the same
    tokens (U+FFFD), streamed or whole; the ending EOS or stop token counts but has no text (as
    in vLLM), and the finish reason is kept."""
    from kvserve.engine.messages import EngineCoreOutput, EngineCoreRequest
    from kvserve.engine.output_processor import OutputProcessor

    hf = transformers.AutoTokenizer.from_pretrained(tok.hf.name_or_path)
    part, (bang,) = _partial_token(tok), ids_of(tok, "!")
    head = ids_of(tok, "Hello")
    ender = {"eos": [tok.eos_token_id], "stop_token": [bang]}.get(then, [])
    ids = [*head, part, *ender]
    params = SamplingParams(max_tokens=len(ids), stop_token_ids=[bang] if then == "stop_token" else None)
    proc = OutputProcessor(tok)
    proc.add_request(EngineCoreRequest("r", [1], params, len(ids), 0.0))
    shown, streamed_ids, final = "", [], None
    for j, t in enumerate(ids):
        last = j == len(ids) - 1 and then != "abort"
        reason = {"eos": "stop", "stop_token": "stop", "length": "length"}[then] if last else None
        stop_reason = bang if last and then == "stop_token" else None
        core_out = EngineCoreOutput("r", [t], reason, stop_reason, stopped_on_token=last and bool(ender))
        (out,), _ = proc.process([core_out])
        shown += out.outputs[0].delta_text
        streamed_ids += out.outputs[0].text_token_ids
        final = out
    if then == "abort":
        final = proc.abort("r")
        shown += final.outputs[0].delta_text
        streamed_ids += final.outputs[0].text_token_ids
    c = final.outputs[0]
    expected = hf.decode([*head, part], skip_special_tokens=True)
    assert expected.endswith("\ufffd")
    assert c.text == shown == expected
    assert streamed_ids == ids and c.token_ids == ids
    assert c.finish_reason == {"eos": "stop", "stop_token": "stop"}.get(then, then)
    assert c.stop_reason == (bang if then == "stop_token" else None)


def _streamed(llm, prompt: str, params: SamplingParams) -> str:
    """The request's text as its streamed deltas give it, through the offline engine's steps."""
    e = llm.llm_engine
    e.add_request("streamed", prompt, params)
    shown = ""
    while e.has_unfinished_requests():
        for out in e.step():
            shown += out.outputs[0].delta_text
    return shown


@pytest.mark.parametrize("include", [False, True])
def test_the_ending_token_has_no_text_unless_asked(llm, include):
    """vLLM leaves the text of the EOS or stop token id that ended a request out of its output
    (the token itself stays in token_ids), unless include_stop_str_in_output: offline, streamed
    and whole; an EOS shown with skip_special_tokens=False too."""
    tok = llm.tokenizer
    (greedy,) = llm.generate(
        "Hello", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False
    )
    third = greedy.outputs[0].token_ids[2]
    cases = [
        SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[third]),
        SamplingParams(
            temperature=0, max_tokens=8, logit_bias={tok.eos_token_id: 100.0}, skip_special_tokens=False
        ),
    ]
    for params in cases:
        params.include_stop_str_in_output = include
        c = llm.generate("Hello", params, use_tqdm=False)[0].outputs[0]
        assert c.finish_reason == "stop" and c.token_ids[-1] in (third, tok.eos_token_id)
        kept = tok.decode(c.token_ids, skip_special_tokens=False)
        assert c.text == (kept if include else tok.decode(c.token_ids[:-1], skip_special_tokens=False))
        assert kept != tok.decode(c.token_ids[:-1], skip_special_tokens=False)  # the token has text
        assert _streamed(llm, "Hello", params) == c.text


def test_generate_keeps_held_bytes_at_a_stop_token(llm):
    """End to end: a forced partial-character token that is also a stop token id (its text left
    out, as vLLM does, unless include_stop_str_in_output), and max_tokens reached on one; text,
    streamed deltas and completion token count agree with the full decode."""
    tok = llm.tokenizer
    part = _partial_token(tok)
    cases = (
        {"stop_token_ids": [part]},
        {"stop_token_ids": [part], "include_stop_str_in_output": True},
        {"max_tokens": 3},
    )
    for extra in cases:
        params = SamplingParams(temperature=0, logit_bias={part: 100.0}, **{"max_tokens": 8, **extra})
        c = llm.generate("Hello", params, use_tqdm=False)[0].outputs[0]
        stop, shows = (
            "stop_token_ids" in extra,
            "include_stop_str_in_output" in extra or "max_tokens" in extra,
        )
        assert c.text == (tok.decode(c.token_ids) if shows else "")
        assert c.text.endswith("\ufffd") == shows
        assert c.finish_reason == ("stop" if stop else "length")
        assert len(c.token_ids) == (1 if stop else 3)
        assert _streamed(llm, "Hello", params) == c.text
    e = llm.llm_engine
    assert e.kv_cache_manager.num_free_blocks == e.kv_cache_manager.num_blocks
