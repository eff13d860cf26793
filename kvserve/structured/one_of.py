"""Whether a oneOf's branches are exclusive, so that writing it as anyOf is exact.

JSON Schema's oneOf asks that a value match exactly one branch; xgrammar 0.2.8 writes it as
anyOf (it logs a warning where it cannot prove the branches apart), so `{"oneOf": [{"type":
"integer"}, {"type": "number"}]}` was answered `1`, which matches both. No grammar of this kind
can say "not the other branch", so schema_support.py refuses a oneOf unless every answer one
branch's grammar writes is proved to break each other branch: unlike types, distinct const or
enum values, a required property whose values are exclusive (a discriminator) or that the
other branch's grammar never writes (xgrammar closes objects), disjoint numeric ranges,
patterns no string matches both of. Each proof is one-sided and conservative: "unsure" is
"they may overlap", so a oneOf is never answered as anyOf on a guess.
"""

from __future__ import annotations

import re
from typing import Any

from kvserve.structured.open_objects import writes_unlisted_names
from kvserve.structured.pattern_overlap import may_overlap
from kvserve.structured.schema_walk import rebuilt_children

_TYPES = frozenset(("null", "boolean", "number", "string", "array", "object"))
_MAX_DEPTH = 12  # nesting followed (through properties and $ref); deeper is "unsure"
# keywords that say nothing about which values match
_ANNOTATIONS = frozenset(("title", "description", "default", "examples", "$comment", "deprecated",
                          "readOnly", "writeOnly", "discriminator", "$id", "$schema", "$anchor"))  # fmt: skip


MAX_PAIRS = 256 * 255
"""Ordered pairs of branches a schema's oneOfs may ask to compare (one oneOf of 256 schemas, about
a second): the proof compares every pair, so 800 branches took 20 s of the API process's CPU."""


def pairs(branches: list) -> int:
    """How many ordered pairs overlapping_branches compares for these branches."""
    return len(branches) * (len(branches) - 1)


def as_any_of(node: Any) -> Any:
    """The schema with each oneOf renamed anyOf (beside no anyOf of its own), for xgrammar: a
    oneOf reaching it is proved exclusive, where anyOf is exact, and xgrammar's oneOf logs that
    it falls back to anyOf wherever it cannot prove that itself, a warning wrong for these."""
    out = rebuilt_children(node, as_any_of)
    if isinstance(out, dict) and "oneOf" in out and "anyOf" not in out:
        out = {("anyOf" if k == "oneOf" else k): v for k, v in out.items()}
    return out


def overlapping_branches(branches: list, root: Any) -> tuple[int, int] | None:
    """The first pair (i, j) of oneOf branches that may both match one answer, or None."""
    for i, gen in enumerate(branches):
        for j, other in enumerate(branches):
            if i != j and not _excludes(gen, other, root, 0):
                return (min(i, j), max(i, j))
    return None


def _excludes(gen: Any, sch: Any, root: Any, depth: int) -> bool:
    """Whether no value the grammar writes for `gen` is valid against `sch` (False: unsure)."""
    if depth > _MAX_DEPTH:
        return False
    if sch is False or gen is False:
        return True
    gen, sch = _target(gen, root), _target(sch, root)
    if not isinstance(gen, dict) or not isinstance(sch, dict) or not gen:
        return False
    if "$ref" in sch:  # $ref beside other keywords: both apply
        rest = {k: v for k, v in sch.items() if k != "$ref"}
        return _excludes(gen, {"$ref": sch["$ref"]}, root, depth + 1) or _excludes(gen, rest, root, depth)
    if "$ref" in gen or any(k in gen for k in ("allOf", "not", "if")):
        return False  # what xgrammar writes for these is not modelled here
    listed = _listed(gen)
    if listed is not None:
        return all(_fails(v, sch, root, depth + 1) for v in listed)
    for key in ("anyOf", "oneOf"):
        if isinstance(gen.get(key), list) and gen[key]:  # the answer is one branch's
            return all(_excludes(b, sch, root, depth + 1) for b in gen[key])
    listed = _listed(sch)
    if listed is not None:  # the grammar writes only values valid against gen's schema
        return all(_fails(v, gen, root, depth + 1) for v in listed)
    for key in ("anyOf", "oneOf"):
        if isinstance(sch.get(key), list) and all(_excludes(gen, b, root, depth + 1) for b in sch[key]):
            return True
    if isinstance(sch.get("allOf"), list) and any(_excludes(gen, b, root, depth + 1) for b in sch["allOf"]):
        return True
    common = _types(gen) & _types(sch)
    return all(_EXCLUSIVE.get(t, _unsure)(gen, sch, root, depth) for t in common)


def _unsure(gen: dict, sch: dict, root: Any, depth: int) -> bool:
    return False


def _objects(gen: dict, sch: dict, root: Any, depth: int) -> bool:
    """A name sch requires that gen's grammar never writes, or a name gen requires whose values
    the two exclude, or counts of names that cannot meet."""
    required = {n for n in gen.get("required", []) if isinstance(n, str)}
    props = gen.get("properties") if isinstance(gen.get("properties"), dict) else {}
    listed = set(props) | required
    open_names = writes_unlisted_names(gen)
    for name in sch.get("required", []) if isinstance(sch.get("required"), list) else []:
        if isinstance(name, str) and not open_names and name not in listed and not _patterns(gen, name):
            return True
    for name in required:
        mine = props.get(name, _name_schema(gen, name))
        if any(_excludes(mine, theirs, root, depth + 1) for theirs in _value_schemas(sch, name)):
            return True
    most = sch.get("maxProperties")
    if _count(most) and len(required) > most:
        return True
    least = sch.get("minProperties")
    return _count(least) and not open_names and not gen.get("patternProperties") and len(listed) < least


def _numbers(gen: dict, sch: dict, root: Any, depth: int) -> bool:
    """Ranges (minimum, maximum, exclusive bounds) that share no number."""
    (glo, glo_x), (ghi, ghi_x) = _range(gen)
    (slo, slo_x), (shi, shi_x) = _range(sch)
    return _below(ghi, ghi_x, slo, slo_x) or _below(shi, shi_x, glo, glo_x)


def _strings(gen: dict, sch: dict, root: Any, depth: int) -> bool:
    """Patterns no string meets both of (gen's is written as a full match, sch's is searched)."""
    mine, theirs = gen.get("pattern"), sch.get("pattern")
    return isinstance(mine, str) and isinstance(theirs, str) and not may_overlap(mine, theirs)


_EXCLUSIVE = {"object": _objects, "number": _numbers, "string": _strings}


def _fails(value: Any, sch: Any, root: Any, depth: int) -> bool:
    """Whether `value` is surely invalid against `sch` (False: valid or unsure)."""
    if depth > _MAX_DEPTH:
        return False
    if sch is False:
        return True
    sch = _target(sch, root)
    if not isinstance(sch, dict):
        return False
    if "$ref" in sch and _fails(value, {"$ref": sch["$ref"]}, root, depth + 1):
        return True
    if isinstance(sch.get("allOf"), list) and any(_fails(value, b, root, depth + 1) for b in sch["allOf"]):
        return True
    for key in ("anyOf", "oneOf"):
        if isinstance(sch.get(key), list) and all(_fails(value, b, root, depth + 1) for b in sch[key]):
            return True
    if _type_of(value) not in _types(sch):
        return True
    listed = _listed(sch)
    if listed is not None and not any(_json_equal(value, v) for v in listed):
        return True
    if isinstance(value, str):
        return _string_fails(value, sch)
    if _type_of(value) == "number":
        (lo, lo_x), (hi, hi_x) = _range(sch)
        return _below(value, False, lo, lo_x) or _below(hi, hi_x, value, False)
    if isinstance(value, dict):
        return _object_fails(value, sch, root, depth)
    return False


def _string_fails(value: str, sch: dict) -> bool:
    low, high = sch.get("minLength"), sch.get("maxLength")
    if (_count(low) and len(value) < low) or (_count(high) and len(value) > high):
        return True
    try:
        return isinstance(sch.get("pattern"), str) and re.search(sch["pattern"], value) is None
    except (re.error, RecursionError):
        return False


def _object_fails(value: dict, sch: dict, root: Any, depth: int) -> bool:
    required = sch.get("required") if isinstance(sch.get("required"), list) else []
    if any(isinstance(n, str) and n not in value for n in required):
        return True
    return any(_fails(v, s, root, depth + 1) for name, v in value.items() for s in _value_schemas(sch, name))


def _value_schemas(sch: dict, name: str) -> list:
    """The schemas JSON Schema applies to the value of `name` (all of them must hold)."""
    props = sch.get("properties") if isinstance(sch.get("properties"), dict) else {}
    found = [props[name]] if name in props else []
    found += _patterns(sch, name)
    if not found and "additionalProperties" in sch:
        found.append(sch["additionalProperties"])
    return found


def _patterns(node: dict, name: str) -> list:
    from kvserve.structured.schema_support import matching_patterns  # (it imports this module)

    patterns = node.get("patternProperties") if isinstance(node.get("patternProperties"), dict) else {}
    return [patterns[p] for p in matching_patterns(patterns, name)]


def _name_schema(node: dict, name: str) -> Any:
    from kvserve.structured.schema_support import required_name_schema  # (it imports this module)

    found = required_name_schema(node, name)
    return {} if found is None else found


def _target(node: Any, root: Any) -> Any:
    """The schema a lone local $ref points at (followed a few times), else the node."""
    for _ in range(8):
        if not isinstance(node, dict) or not isinstance(node.get("$ref"), str):
            return node
        if set(node) - _ANNOTATIONS != {"$ref"}:
            return node
        found = _pointer(root, node["$ref"])
        if found is None:
            return node
        node = found
    return node


def _pointer(root: Any, ref: str) -> Any:
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _listed(node: dict) -> list | None:
    if "const" in node:
        return [node["const"]]
    return node["enum"] if isinstance(node.get("enum"), list) else None


def _types(node: Any) -> frozenset[str]:
    """The JSON types a schema may take by its type / const / enum (integer read as number)."""
    if not isinstance(node, dict):
        return _TYPES
    listed = _listed(node)
    if listed is not None:
        return frozenset(_type_of(v) for v in listed)
    named = node.get("type")
    names = [named] if isinstance(named, str) else named if isinstance(named, list) else None
    if names is None:
        return _TYPES
    return frozenset("number" if t == "integer" else t for t in names if isinstance(t, str)) & _TYPES


def _type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), "unknown")


def _json_equal(a: Any, b: Any) -> bool:
    """JSON Schema's equality: 1 equals 1.0, true does not equal 1."""
    if _type_of(a) != _type_of(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    return a == b


def _range(node: dict) -> tuple[tuple[Any, bool], tuple[Any, bool]]:
    """((low, exclusive), (high, exclusive)); None where unbounded."""
    low, high = (None, False), (None, False)
    for key, exclusive in (("minimum", False), ("exclusiveMinimum", True)):
        v = node.get(key)
        if _number(v) and (low[0] is None or v > low[0] or (v == low[0] and exclusive)):
            low = (v, exclusive)
    for key, exclusive in (("maximum", False), ("exclusiveMaximum", True)):
        v = node.get(key)
        if _number(v) and (high[0] is None or v < high[0] or (v == high[0] and exclusive)):
            high = (v, exclusive)
    return low, high


def _below(high: Any, high_x: bool, low: Any, low_x: bool) -> bool:
    """Whether every number up to `high` lies below every number from `low`."""
    if high is None or low is None:
        return False
    return high < low or (high == low and (high_x or low_x))


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
