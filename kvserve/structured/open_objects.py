"""JSON Schema's default for a missing additionalProperties / items, where a schema needs it.

xgrammar 0.2.8 (as vLLM runs it, strict mode) reads an object without `additionalProperties`
as closed and an array with `prefixItems` but no `items` as ending there: an answer holds only
the names and items the schema lists. JSON Schema reads both as open (any other name, any
further item), and a schema may need that: `{"type": "object", "minProperties": 1}` was refused
with xgrammar's message ("additional properties aren't allowed"), though `{"a": 1}` meets it, and
`{"type": "array", "minItems": 2}` ("minItems is greater than the number of prefixItems").
Where the listed names or items cannot meet minProperties / minItems, the missing keyword is
written as JSON Schema's default (true); everywhere else answers stay strict, as in vLLM. A
schema that says false itself and still asks for more is refused (`closed_too_small`).
"""

from __future__ import annotations

from typing import Any

from kvserve.structured.counts import counted
from kvserve.structured.schema_walk import rebuilt_children


def open_where_needed(node: Any) -> Any:
    """The schema with additionalProperties / items: true written where an object's properties
    or an array's prefixItems are too few for its minProperties / minItems."""
    out = rebuilt_children(node, open_where_needed)
    if not isinstance(out, dict):
        return out
    if _too_few_names(out) and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = True
    if _too_few_items(out) and "items" not in out and "unevaluatedItems" not in out:
        out["items"] = True
    return out


def closed_too_small(node: dict) -> tuple[str, str] | None:
    """(keyword, why) when a schema closed by its own `false` cannot hold the minimum it asks."""
    closed = False in (node.get("additionalProperties"), node.get("unevaluatedProperties"))
    if _too_few_names(node) and closed:
        n = len(node["properties"]) if isinstance(node.get("properties"), dict) else 0
        return "minProperties", (
            f"minProperties is {node['minProperties']}, but additionalProperties is false and properties "
            f"defines {counted(n, 'name')}: no object meets it"
        )
    if _too_few_items(node) and False in (node.get("items"), node.get("unevaluatedItems")):
        return "minItems", (
            f"minItems is {node['minItems']}, but items is false and prefixItems lists "
            f"{len(node.get('prefixItems') or [])}: no array meets it"
        )
    return None


def writes_unlisted_names(node: dict) -> bool:
    """Whether the grammar may write a name the object neither lists nor matches by a pattern:
    additionalProperties (or unevaluatedProperties) true or a schema, or missing where the
    listed names are too few for minProperties (opened above); missing elsewhere is closed."""
    extra = node.get("additionalProperties", node.get("unevaluatedProperties"))
    return _too_few_names(node) if extra is None else extra is not False


def _too_few_names(node: dict) -> bool:
    least = node.get("minProperties")
    if not _is_count(least) or isinstance(node.get("patternProperties"), dict):
        return False
    props = node.get("properties")
    return least > (len(props) if isinstance(props, dict) else 0)


def _too_few_items(node: dict) -> bool:
    """An array with no prefixItems lists none: {"type": "array", "minItems": 2} was refused in
    xgrammar's words ("minItems is greater than the number of prefixItems") though [1, 2] meets it."""
    least, prefix = node.get("minItems"), node.get("prefixItems")
    if prefix is None and _is_array(node):
        prefix = []
    return _is_count(least) and isinstance(prefix, list) and least > len(prefix)


def _is_array(node: dict) -> bool:
    kind = node.get("type")
    return kind == "array" or (isinstance(kind, list) and "array" in kind)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
