"""A schema of several types written as the anyOf of one schema per type, before the rewrites.

xgrammar 0.2.8 writes `"type": ["number", "null"]` as one branch per type, each holding the
schema's keywords. The rewrites before it (exact_formats, integer_bounds, number_forms) each look
for one type, `"type": "number"` and the like, and passed a list by: a nullable number, as
OpenAI's strict mode writes every optional field, was bounded by xgrammar's six decimals again
(0.5000001 refused under `exclusiveMinimum: 0.5`, 1e30 under `maximum: 1e30`), a nullable integer
refused -0 and a bound that is not whole ("Integer constraint must be a whole number"), a
nullable date took 2024-04-31. Here such a schema is the anyOf xgrammar would make of it, each
branch one type with that type's keywords (and those of no type), so each rewrite reads its own
type; a number branch whose bounds leave no value is left out, as no value could take it.
"""

from __future__ import annotations

from typing import Any

from kvserve.structured.number_forms import empty_range
from kvserve.structured.schema_walk import rebuilt_children

_NUMBER = frozenset(("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"))
# The keywords only one type reads; the others go to every branch, but these stay on the whole.
_OWN = {
    "string": frozenset(("minLength", "maxLength", "pattern", "format", "contentEncoding",
                         "contentMediaType")),
    "number": _NUMBER,
    "integer": _NUMBER,
    "array": frozenset(("items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems",
                        "contains", "minContains", "maxContains", "unevaluatedItems")),
    "object": frozenset(("properties", "patternProperties", "additionalProperties", "required",
                         "minProperties", "maxProperties", "propertyNames", "dependentRequired",
                         "dependentSchemas", "dependencies", "unevaluatedProperties")),
}  # fmt: skip
_KINDS = frozenset((*_OWN, "boolean", "null"))
_TYPED = frozenset().union(*_OWN.values())
_WHOLE = frozenset(("$defs", "definitions", "$schema", "$id", "$comment", "title", "description", "default",
                    "examples", "deprecated", "readOnly", "writeOnly"))  # fmt: skip
# Beside these the list is left to xgrammar as before: wrapping would change what they combine.
_COMBINED = frozenset(("anyOf", "oneOf", "allOf", "$ref", "enum", "const", "not", "if", "then", "else"))


def split_type_lists(node: Any) -> Any:
    """The schema with each list of types (beside no combining keyword) an anyOf of one type each."""
    out = rebuilt_children(node, split_type_lists)
    if not isinstance(out, dict) or not _splittable(out):
        return out
    branches = [_branch(out, kind) for kind in dict.fromkeys(out["type"])]
    kept = [b for b in branches if empty_range(b) is None] or branches
    whole = {k: v for k, v in out.items() if k in _WHOLE}
    if len(kept) == 1:
        return {**whole, **kept[0]}
    return {**whole, "anyOf": kept}


def type_branch(node: dict, kind: str) -> dict | None:
    """The one-type schema split_type_lists writes for `kind` from the node's list of types (the
    checks read it as the rewrites will), or None where the node is not split or lacks the kind."""
    if not _splittable(node) or kind not in node["type"]:
        return None
    return _branch(node, kind)


def _branch(node: dict, kind: str) -> dict:
    own = _OWN.get(kind, frozenset())
    branch = {k: v for k, v in node.items() if k not in _WHOLE and (k in own or k not in _TYPED)}
    return {**branch, "type": kind}


def _splittable(node: dict) -> bool:
    kinds = node.get("type")
    if not isinstance(kinds, list) or not kinds or any(k in node for k in _COMBINED):
        return False
    return all(isinstance(k, str) and k in _KINDS for k in kinds)
