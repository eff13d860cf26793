"""A property whose schema is `false`, JSON Schema's "this name must not be present".

xgrammar 0.2.8 refuses any `false` subschema ("Schema 'false' cannot accept any value"), so
`{"type": "object", "properties": {"a": false}}`, valid JSON Schema that `{}` meets, was a 400.
Objects here are closed to unlisted names (xgrammar's strict mode), so leaving such a property
out of `properties` is exact: the grammar never writes the name. Where the object writes other
names too (additionalProperties true or a schema, propertyNames, or a pattern that matches it),
leaving it out would let the name back in, so schema_support.py refuses it; a required one no
object meets, refused as unsatisfiable. A `false` branch of anyOf / oneOf matches nothing: it is left out too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvserve.structured.open_objects import writes_unlisted_names
from kvserve.structured.schema_walk import rebuilt_children


def without_false(node: Any) -> Any:
    """The schema with each `false` property and each `false` anyOf / oneOf branch left out (a
    list of branches all `false` kept as it is, for xgrammar to refuse)."""
    out = rebuilt_children(node, without_false)
    if not isinstance(out, dict):
        return out
    if isinstance(out.get("properties"), dict) and False in out["properties"].values():
        out["properties"] = {k: v for k, v in out["properties"].items() if v is not False}
    for key in ("anyOf", "oneOf"):
        branches = out.get(key)
        if isinstance(branches, list) and False in branches and any(b is not False for b in branches):
            out[key] = [b for b in branches if b is not False]
    return out


def required_false(node: dict) -> tuple[str, str] | None:
    """("required", why) when a required name's schema is `false`: no object meets it."""
    required = node.get("required") if isinstance(node.get("required"), list) else []
    for name in _false_names(node):
        if name in required:
            return "required", f"the required property {name!r} has the schema false: no object meets it"
    return None


def false_name_written(node: dict, matches: Callable[[str], list[str]]) -> tuple[str, str] | None:
    """("properties", why) when a `false` property's name could still be written: the object
    writes unlisted names, or `matches(name)` (the patterns matching it) is not empty, or it has
    propertyNames (xgrammar writes the names those allow, additionalProperties false or not)."""
    for name in _false_names(node):
        patterns = matches(name)
        if patterns or "propertyNames" in node or writes_unlisted_names(without_false(node)):
            beside = (
                f"the pattern {patterns[0]!r}" if patterns
                else "the names propertyNames allows" if "propertyNames" in node
                else "unlisted names (additionalProperties)"
            )  # fmt: skip
            return "properties", (
                f"the property {name!r} has the schema false (it must not be present), which is not enforced "
                f"where the object writes {beside}; leave {name!r} out or close the object"
            )
    return None


def _false_names(node: dict) -> list[str]:
    props = node.get("properties")
    return [k for k, v in props.items() if v is False] if isinstance(props, dict) else []
