"""Required names that only a patternProperties pattern defines, made properties.

xgrammar 0.2.8 writes every patternProperties key as optional whatever `required` says, so
{"patternProperties": {"^a$": {"type": "integer"}}, "required": ["a"]} was answered `{}`. Each
such name (one pattern matching it: schema_support.py refuses a name that several or none
define) is added to `properties` with that pattern's schema, which xgrammar does require.
"""

from __future__ import annotations

from typing import Any

from kvserve.structured.schema_support import matching_patterns

_DATA = ("const", "enum", "default", "examples")  # values that are data, not schemas


def require_pattern_names(node: Any) -> Any:
    """The schema with each required name a single pattern defines added to `properties`."""
    if isinstance(node, list):
        return [require_pattern_names(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: v if k in _DATA else require_pattern_names(v) for k, v in node.items()}
    required, patterns = out.get("required"), out.get("patternProperties")
    if isinstance(required, list) and isinstance(patterns, dict):
        props = dict(out["properties"]) if isinstance(out.get("properties"), dict) else {}
        for name in required:
            if isinstance(name, str) and name not in props:
                matched = matching_patterns(patterns, name)
                if len(matched) == 1:
                    props[name] = patterns[matched[0]]
        out["properties"] = props
    return out
