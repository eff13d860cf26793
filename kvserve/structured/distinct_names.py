"""A minProperties that only names the schema does not list can meet, refused.

xgrammar 0.2.8 writes an object's unlisted names (additionalProperties', or a patternProperties
key) as a repeatable item and never keeps them apart, so `{"type": "object", "minProperties":
2}` was answered `{"b": 1, "b": 2}` (or `{"b": 1, "\\u0062": 2}`): two names to the grammar's
count, one to JSON's, which keeps the last, so the answer broke minProperties. A listed name is
written at most once. Where the required names fall two or more short of minProperties, the
count can be filled by a repeated unlisted name, and no grammar of this kind can say "a name
not written before"; such a schema is refused. With at most one unlisted name needed, a repeat
only adds to a count already met.
"""

from __future__ import annotations

from kvserve.structured.counts import counted
from kvserve.structured.open_objects import writes_unlisted_names


def repeatable_count(node: dict) -> tuple[str, str] | None:
    """("minProperties", why) when a repeated unlisted name could make up minProperties."""
    least = node.get("minProperties")
    if not isinstance(least, int) or isinstance(least, bool):
        return None
    required = node.get("required") if isinstance(node.get("required"), list) else []
    named = len({n for n in required if isinstance(n, str)})
    patterns = node.get("patternProperties")
    unlisted = writes_unlisted_names(node) or (isinstance(patterns, dict) and bool(patterns))
    if not unlisted or least < named + 2:
        return None
    return "minProperties", (
        f"minProperties is {least} and {counted(named, 'name')} {'is' if named == 1 else 'are'} required: "
        "names the schema does not list may make "
        'up the count, and they are not kept distinct ({"b": 1, "b": 2} counts two; JSON reads one); '
        f"require at least {counted(least - 1, 'name')}, or lower minProperties to {named + 1}"
    )
