"""A tool's parameters placed inside tool_choice "required"'s array schema, their $refs kept.

A local `$ref` is a JSON pointer from the root of the schema it is written in: a tool's
`"#/$defs/City"` (pydantic writes one for every nested model) or `"#"` (a recursive one) points
into its own parameters. Nested under the array's items as they were, each pointed at the array
schema instead, and the request was a 400 ("Cannot find field $defs in #/$defs/City") though the
same tool forced by name was answered. Parameters holding a local `$ref` are placed under the
array schema's own `$defs` and referenced from there, each of their pointers prefixed with
their new place.
"""

from __future__ import annotations

from typing import Any

from kvserve.structured.schema_walk import rebuilt_children


def placed(params: Any, key: str, defs: dict[str, Any]) -> Any:
    """The schema to write for `params` in the array's call: themselves where they hold no local
    $ref, else a $ref to `defs[key]`, where they are stored with their pointers moved there."""
    if not _has_local_ref(params):
        return params
    defs[key] = _moved(params, f"#/$defs/{key}")
    return {"$ref": f"#/$defs/{key}"}


def _moved(node: Any, base: str) -> Any:
    out = rebuilt_children(node, lambda child: _moved(child, base))
    if isinstance(out, dict) and isinstance(out.get("$ref"), str) and out["$ref"].startswith("#"):
        out["$ref"] = base + out["$ref"][1:]
    return out


def _has_local_ref(node: Any) -> bool:
    found = False

    def look(child: Any) -> Any:
        nonlocal found
        if isinstance(child, dict) and isinstance(child.get("$ref"), str) and child["$ref"].startswith("#"):
            found = True
        return rebuilt_children(child, look)

    look(node)
    return found
