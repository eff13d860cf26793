"""One traversal of a JSON schema for the rewrites here (pattern_required, open_objects, and the
placeholder swaps in json_strings, listed_spacing and number_forms): a schema rebuilt subschema
by subschema. Values that are data (const, enum, default, examples) are kept as they are, and a
map of named subschemas (properties, $defs...) is walked name by name, so a property named
"default" or "enum" is still a schema (each rewrite used to carry its own copy of these rules,
and two of them read such a property as data and left it out)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

DATA = ("const", "enum", "default", "examples")  # values that are data, not schemas
NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema


def rebuilt_children(node: Any, rebuild: Callable[[Any], Any]) -> Any:
    """A copy of `node` with `rebuild` applied to each subschema under it (each item of a
    list; each value of an object but data, each named subschema of a NAMED map); anything
    else as it is. The caller's rebuild recurses through this function again."""
    if isinstance(node, list):
        return [rebuild(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in DATA:
            out[key] = value
        elif key in NAMED and isinstance(value, dict):
            out[key] = {name: rebuild(schema) for name, schema in value.items()}
        else:
            out[key] = rebuild(value)
    return out
