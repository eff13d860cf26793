"""propertyNames where xgrammar does not enforce it: on the names an object lists, and beside
additionalProperties false.

xgrammar 0.2.8 writes propertyNames only as the grammar of the names an object does not list:
`{"properties": {"c": ...}, "propertyNames": {"pattern": "^[ab]$"}}` was answered `{"c": 1}`,
whose name breaks it, and beside `additionalProperties: false` it still wrote unlisted names
(`{"a": 1}`) that the false forbids. A listed name propertyNames refuses is refused with a 400
naming it (as is one it cannot be checked against here); beside a closing false, where the
listed names are then all the names there are, propertyNames is left out: it has nothing left
to constrain.
"""

from __future__ import annotations

import re
from typing import Any

from kvserve.structured.schema_walk import rebuilt_children

# propertyNames keywords a listed name is checked against here (and annotations)
_CHECKED = frozenset(("type", "pattern", "minLength", "maxLength", "enum", "const", "title", "description",
                      "$comment"))  # fmt: skip


def without_closed_names(node: Any) -> Any:
    """The schema with propertyNames left out of each object closed by its own false."""
    out = rebuilt_children(node, without_closed_names)
    if isinstance(out, dict) and "propertyNames" in out and _closed(out):
        out = {k: v for k, v in out.items() if k != "propertyNames"}
    return out


def listed_name_refused(node: dict) -> tuple[str, str] | None:
    """("propertyNames", why) when a name `properties` lists breaks propertyNames beside it, or
    propertyNames holds a keyword a listed name is not checked against here."""
    names, props = node.get("propertyNames"), node.get("properties")
    if not isinstance(names, dict) or not isinstance(props, dict) or not props:
        return None
    unchecked = sorted(set(names) - _CHECKED)
    if unchecked:
        return "propertyNames", (
            f"{unchecked[0]} in propertyNames is not enforced on the names properties lists; give the names "
            "as pattern, minLength, maxLength, enum or const"
        )
    for name in props:
        if not _allows(names, name):
            return "propertyNames", (
                f"the property {name!r} breaks propertyNames beside it, which is not enforced on the names "
                "properties lists; leave it out or widen propertyNames"
            )
    return None


def _allows(names: dict, name: str) -> bool:
    kind = names.get("type", "string")
    if kind != "string" and not (isinstance(kind, list) and "string" in kind):
        return False
    pattern = names.get("pattern")
    try:
        if isinstance(pattern, str) and re.search(pattern, name) is None:
            return False
    except re.error:
        return False
    low, high = names.get("minLength", 0), names.get("maxLength")
    if (isinstance(low, int) and len(name) < low) or (isinstance(high, int) and len(name) > high):
        return False
    if isinstance(names.get("enum"), list) and name not in names["enum"]:
        return False
    return "const" not in names or names["const"] == name


def _closed(node: dict) -> bool:
    return False in (node.get("additionalProperties"), node.get("unevaluatedProperties")) and not isinstance(
        node.get("patternProperties"), dict
    )
