"""An enum or const value that breaks a keyword beside it.

xgrammar 0.2.8 writes a schema with `enum` or `const` as the listed values alone: the keywords
beside them are dropped, so {"enum": ["aaaa", "b"], "maxLength": 2} answered "aaaa" and
{"type": "integer", "enum": [1, "a"]} answered "a", which the schema refuses. A listed value
the keywords here refuse makes schema_support.py refuse the schema, naming both; keywords not
checked here (format, array and object ones) are left alone.
"""

from __future__ import annotations

import re
from typing import Any

from kvserve.structured.json_numbers import finite_number

_TYPES = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: (
        isinstance(v, int) and not isinstance(v, bool) or isinstance(v, float) and v.is_integer()
    ),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}


def broken_keyword(node: dict) -> tuple[Any, str] | None:
    """(the first listed value a keyword beside it refuses, that keyword), or None."""
    if isinstance(node.get("enum"), list):
        values = node["enum"]
    else:
        values = [node["const"]] if "const" in node else []
    for value in values:
        for key in _TYPE_AND_BOUNDS:
            if key in node and not _meets(key, node[key], value):
                return value, key
    return None


_TYPE_AND_BOUNDS = ("type", "minLength", "maxLength", "pattern", "minimum", "maximum", "exclusiveMinimum",
                    "exclusiveMaximum")  # fmt: skip


def _meets(key: str, bound: Any, value: Any) -> bool:
    """Whether `value` meets one keyword (a keyword that does not apply to its type, or that
    cannot be read here, is met)."""
    if key == "type":
        kinds = bound if isinstance(bound, list) else [bound]
        return not all(k in _TYPES for k in kinds) or any(_TYPES[k](value) for k in kinds)
    if key in ("minLength", "maxLength", "pattern"):
        if not isinstance(value, str):
            return True
        if key == "pattern":
            try:
                return not isinstance(bound, str) or re.search(bound, value) is not None
            except re.error:
                return True
        if isinstance(bound, bool) or not isinstance(bound, int):
            return True
        return len(value) >= bound if key == "minLength" else len(value) <= bound
    number = _TYPES["number"]
    if not number(value) or not number(bound) or not finite_number(value):
        return True
    return {
        "minimum": value >= bound,
        "maximum": value <= bound,
        "exclusiveMinimum": value > bound,
        "exclusiveMaximum": value < bound,
    }[key]
