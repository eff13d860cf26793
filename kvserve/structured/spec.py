"""What a request asks to be constrained to, as a cache key and as an xgrammar Grammar.

`check()` parses without a tokenizer, so the caller's side (API process, offline LLM) can
refuse an invalid schema, regex or grammar with a ValueError that names the problem before
anything reaches the engine core.
"""

from __future__ import annotations

import functools
import json
import re

from kvserve.sampling_params import StructuredOutputsParams
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
            xgr.Grammar.from_json_schema(text, any_whitespace=False)
            refused = unsupported(json.loads(text))
            if refused is not None:
                key, where, why = refused
                raise ValueError(f"{key} at {where} is not supported: {why}")
        elif kind == "regex":
            xgr.Grammar.from_regex(text)
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(text)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"structured_outputs: invalid {label}: {clean_error(e)}") from None


def clean_error(e: Exception) -> str:
    lines = [_LOCATION.sub("", ln).strip() for ln in str(e).splitlines()]
    return " ".join(ln for ln in lines if ln) or type(e).__name__
