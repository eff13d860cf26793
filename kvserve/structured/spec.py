"""What a request asks to be constrained to, as a cache key and as an xgrammar Grammar.

`check()` parses without a tokenizer, so the caller's side (API process, offline LLM) can
refuse an invalid schema, regex or grammar with a ValueError that names the problem before
anything reaches the engine core.
"""

from __future__ import annotations

import functools
import json
import re
import threading

from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured.productive import unproductive_root
from kvserve.structured.schema_support import unsupported

# xgrammar's errors start with "[hh:mm:ss] /path/file.cc:123: "; the rest is the message.
_LOCATION = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")

GrammarKey = tuple[str, str]


def grammar_key(so: StructuredOutputsParams) -> GrammarKey:
    """(kind, text): the compile-cache key; equal specs share one compiled grammar."""
    if so.json is not None:
        return ("json", so.json)
    if so.json_object:
        return ("json_object", "")
    if so.regex is not None:
        return ("regex", so.regex)
    if so.choice is not None:
        return ("grammar", choice_ebnf(so.choice))
    assert so.grammar is not None
    return ("grammar", so.grammar)


def choice_ebnf(choices: list[str]) -> str:
    """One alternative per choice; JSON string escapes are valid EBNF string literals."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def check(so: StructuredOutputsParams) -> None:
    """Parse the grammar; raises ValueError("structured_outputs: invalid <kind>: <why>")."""
    _check_key(*grammar_key(so), "choice" if so.choice is not None else None)


@functools.lru_cache(maxsize=256)
def _check_key(kind: str, text: str, label: str | None) -> None:
    import xgrammar as xgr

    label = label or {"json": "json schema", "regex": "regex", "grammar": "grammar"}.get(kind, kind)
    try:
        if kind == "json":
            _refuse_if_endless(xgr.Grammar.from_json_schema(text, any_whitespace=False))
            refused = unsupported(json.loads(text))
            if refused is not None:
                key, where, why = refused
                raise ValueError(f"{key} at {where} is not supported: {why}")
        elif kind == "regex":
            _refuse_if_empty(xgr.Grammar.from_regex(text))
        elif kind == "grammar":
            grammar = xgr.Grammar.from_ebnf(text)
            _refuse_if_empty(grammar)
            _refuse_if_endless(grammar)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"structured_outputs: invalid {label}: {clean_error(e)}") from None


_byte_compiler = None
_byte_lock = threading.Lock()
_STOP = 256  # the byte vocabulary's stop token


def _refuse_if_empty(grammar) -> None:
    """Raise ValueError when the grammar matches no text at all (e.g. `root ::= root`).

    xgrammar parses such a grammar, and its matcher then allows no first token and cannot
    end: every token the model samples is refused, so the request would answer empty text and
    log a warning. Compiled against a vocabulary of the 256 single bytes plus a stop token (a
    few milliseconds, independent of the model), a grammar that matches some text allows its
    first byte, or the stop token when it matches the empty text; one that matches none allows
    nothing. JSON schemas are not checked here: xgrammar refuses the empty ones itself
    (`false`, an empty enum, minimum above maximum), and a large schema compiles slowly.
    """
    import xgrammar as xgr

    global _byte_compiler
    with _byte_lock:  # the API process's threads share one compiler
        if _byte_compiler is None:
            vocab = [bytes([b]) for b in range(256)] + [b"</s>"]
            info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, stop_token_ids=[_STOP])
            _byte_compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        compiled = _byte_compiler.compile_grammar(grammar)
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, _STOP + 1)
    matcher.fill_next_token_bitmask(bitmask)
    if not bool(bitmask.any()):
        raise ValueError("it matches no text (no first character is allowed and it cannot end)")


def _refuse_if_endless(grammar) -> None:
    """Raise ValueError when every derivation recurses forever (e.g. `root ::= "a" root`).

    Such a grammar allows a first byte, so `_refuse_if_empty` passes it, but no text ever
    completes it: the request could only stop at max_tokens, with output the schema or grammar
    never accepts. A required self-reference in a JSON schema is the same case.
    """
    if unproductive_root(grammar):
        raise ValueError("it matches no finite text (every derivation of root recurses forever)")


def clean_error(e: Exception) -> str:
    lines = [_LOCATION.sub("", ln).strip() for ln in str(e).splitlines()]
    return " ".join(ln for ln in lines if ln) or type(e).__name__
