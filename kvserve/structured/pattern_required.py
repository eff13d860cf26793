"""Required names that `properties` does not define, made properties.

xgrammar 0.2.8 writes every patternProperties key as optional whatever `required` says, and
leaves out a required name nothing defines, so {"patternProperties": {"^a$": {"type":
"integer"}}, "required": ["a"]} and {"type": "object", "required": ["a"]} were answered `{}`.
Each such name is added to `properties` with the schema JSON Schema gives its value, which
xgrammar does require: the schema of the patterns matching it (one, or several alike), else
additionalProperties' (any value where it is missing or true). schema_support.py refuses a name
no object can hold (additionalProperties false) or that unlike patterns define.
"""

from __future__ import annotations

from typing import Any

from kvserve.structured.schema_support import required_name_schema
from kvserve.structured.schema_walk import rebuilt_children


def require_pattern_names(node: Any) -> Any:
    """The schema with each required name `properties` lacks added to it, where its value's
    schema is known (as above)."""
    out = rebuilt_children(node, require_pattern_names)
    if not isinstance(out, dict):
        return out
    required = out.get("required")
    if isinstance(required, list):
        props = dict(out["properties"]) if isinstance(out.get("properties"), dict) else {}
        for name in required:
            if isinstance(name, str) and name not in props:
                schema = required_name_schema(out, name)
                if schema is not None:
                    props[name] = schema
        if props:
            out["properties"] = props
    return out
