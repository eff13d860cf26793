"""An object or array const / enum value, written with the grammar's spacing as well, and a
listed number as the schema wrote it.

xgrammar 0.2.8 writes every other object and array of a schema with ", " and ": " between
tokens, but a listed object or array as its compact text alone: {"const": {"a": 1}} took
`{"a":1}` and refused `{"a": 1}`, the way every other object in the answer is written (and
the way a model writes JSON). It writes a listed number through a double's 17 digits: `0.1`
only as `0.10000000000000001`, `1e-7` as `9.9999999999999995e-08`, and an integer past 64 bits
as another number (10**20 + 5 as `1e+20`). Each such value is swapped for a placeholder string
before xgrammar converts the schema, and the placeholder's literal for its spellings after (a
number: its shortest text, and a whole float's digits too: `100.0` or `100`).
"""

from __future__ import annotations

import json
from typing import Any

from kvserve.structured.json_numbers import finite_number
from kvserve.structured.schema_walk import rebuilt_children

_SEPARATORS = ((",", ":"), (", ", ": "))  # compact, and as xgrammar writes the rest


def swap_listed(node: Any, values: list) -> Any:
    """The schema with each object, array or number const / enum value replaced by a
    placeholder string (the value appended to `values`)."""
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
        if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
            spellings.add(str(int(value)))
        ebnf = ebnf.replace(literal, "(" + " | ".join(_literal(t) for t in sorted(spellings)) + ")")
    return ebnf


def _swapped(value: Any, values: list) -> Any:
    listed_number = finite_number(value)
    if not isinstance(value, (dict, list)) and not listed_number:
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
