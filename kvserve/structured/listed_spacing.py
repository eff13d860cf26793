"""An object or array const / enum value, written with the grammar's spacing as well.

xgrammar 0.2.8 writes every other object and array of a schema with ", " and ": " between
tokens, but a listed object or array as its compact text alone: {"const": {"a": 1}} took
`{"a":1}` and refused `{"a": 1}`, the way every other object in the answer is written (and
the way a model writes JSON). Each such value is swapped for a placeholder string before
xgrammar converts the schema, and the placeholder's literal for both spellings after.
"""

from __future__ import annotations

import json
from typing import Any

from kvserve.structured.schema_walk import rebuilt_children

_SEPARATORS = ((",", ":"), (", ", ": "))  # compact, and as xgrammar writes the rest


def swap_listed(node: Any, values: list) -> Any:
    """The schema with each object or array const / enum value replaced by a placeholder
    string (the value appended to `values`)."""
    out = rebuilt_children(node, lambda v: swap_listed(v, values))
    if isinstance(out, dict) and "const" in out:
        out["const"] = _swapped(out["const"], values)
    if isinstance(out, dict) and isinstance(out.get("enum"), list):
        out["enum"] = [_swapped(v, values) for v in out["enum"]]
    return out


def with_listed(ebnf: str, values: list) -> str:
    """The EBNF with each placeholder's literal as its value, compact or spaced (one xgrammar
    left out, as in an unused $defs schema, is skipped); ValueError when a placeholder is
    left in another spelling."""
    for i, value in enumerate(values):
        literal = _literal(json.dumps(_placeholder(i)))
        if _placeholder(i) in ebnf.replace(literal, ""):
            raise ValueError(f"listed value {i} is not where it was expected")
        spellings = {json.dumps(value, ensure_ascii=False, separators=sep) for sep in _SEPARATORS}
        ebnf = ebnf.replace(literal, "(" + " | ".join(_literal(t) for t in sorted(spellings)) + ")")
    return ebnf


def _swapped(value: Any, values: list) -> Any:
    if not isinstance(value, (dict, list)):
        return value
    values.append(value)
    return _placeholder(len(values) - 1)


def _placeholder(i: int) -> str:
    return f"kvservelisted{i}z"


def _literal(text: str) -> str:
    """Text as an EBNF string literal: quote and backslash escaped, anything outside printable
    ASCII as a code point escape."""
    out = []
    for ch in text:
        cp = ord(ch)
        if 0x20 <= cp < 0x7F:
            out.append("\\" + ch if ch in '"\\' else ch)
        else:
            out.append(f"\\u{cp:04x}" if cp <= 0xFFFF else f"\\U{cp:08x}")
    return '"' + "".join(out) + '"'
