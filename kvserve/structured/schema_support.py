"""JSON-schema keywords the grammar backend would silently not enforce.

xgrammar (0.2.8) compiles these to a grammar that accepts what they forbid, so an answer could
break its own schema while reporting finish_reason "stop". Such a schema is refused with a 400
naming the keyword and where it is, as OpenAI's strict mode refuses keywords it does not
support (vLLM's xgrammar backend refuses much the same list). tests/test_schema_support.py
checks xgrammar still ignores each one, so the list shrinks when xgrammar learns them.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator
from typing import Any

from kvserve.structured.distinct_names import repeatable_count
from kvserve.structured.false_schemas import false_name_written, required_false
from kvserve.structured.integer_bounds import multiple_refused
from kvserve.structured.listed_values import broken_keyword
from kvserve.structured.number_forms import empty_range
from kvserve.structured.one_of import MAX_PAIRS, overlapping_branches, pairs
from kvserve.structured.open_objects import closed_too_small
from kvserve.structured.pattern_overlap import may_overlap
from kvserve.structured.property_names import listed_name_refused
from kvserve.structured.type_lists import type_branch

# keyword -> why it is refused (what the grammar would do instead)
UNSUPPORTED = {
    "not": "a negated schema is not enforced",
    "if": "conditional schemas (if/then/else) are not enforced",
    "then": "conditional schemas (if/then/else) are not enforced",
    "else": "conditional schemas (if/then/else) are not enforced",
    "contains": "contains is not enforced",
    "dependentRequired": "dependentRequired is not enforced",
    "dependentSchemas": "dependentSchemas is not enforced",
    "dependencies": "dependencies is not enforced",
}
# The string formats xgrammar 0.2.8 writes a grammar for (others it ignores, keeping the rest).
ENFORCED_FORMATS = frozenset(
    ("date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uri-reference",
     "uuid", "uri-template", "json-pointer", "relative-json-pointer")
)  # fmt: skip
_ONE_OF_OVERLAP = (
    "its schemas {} and {} may both match one value, and oneOf's exactly one is not enforced; make them "
    "exclusive (unlike types, distinct const or enum values, a required property with distinct const values) "
    "or use anyOf"
)
_ONE_OF_WORK = (
    "proving its {} schemas exclusive compares {:,} pairs, past the {:,} a schema's oneOfs may compare "
    "(one oneOf of 256 schemas); use anyOf, or fewer schemas"
)
# Keywords xgrammar reads only beside the type they constrain: with no "type" it writes any value,
# so {"pattern": "^a$"} answered "b" and {"minimum": 5} 1 (object keywords and items, prefixItems
# make it infer the type, and are enforced).
_TYPED_ONLY = ("pattern", "minLength", "maxLength", "format", "minimum", "maximum", "exclusiveMinimum",
               "exclusiveMaximum", "multipleOf", "minItems", "maxItems")  # fmt: skip
_UNTYPED = (
    'without a "type" beside it, {} is not enforced (any value would be written); give the type it '
    'constrains, such as "type": "string" or "type": ["string", "null"]'
)
_ONE_SCHEMA = ("additionalProperties", "items", "unevaluatedProperties", "unevaluatedItems",
               "propertyNames", "contains", "not", "if", "then", "else")  # fmt: skip
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def unsupported(schema: Any) -> tuple[str, str, str] | None:
    """(keyword, JSON pointer of its schema, why) of the first keyword not enforced, or None."""
    compared = 0
    for path, node in _subschemas(schema, ""):
        for key, why in UNSUPPORTED.items():
            if key in node:
                return key, path or "/", why
        if node.get("uniqueItems") is True:
            return "uniqueItems", path or "/", "unique items are not enforced"
        flag = _draft4_flag(node)
        if flag is not None:
            return flag[0], path or "/", flag[1]
        for key in ("anyOf", "oneOf"):  # no alternative: xgrammar accepts an empty answer instead
            if node.get(key) == []:
                return key, path or "/", f"an empty {key} matches no value; give at least one schema"
        if isinstance(node.get("oneOf"), list) and len(node["oneOf"]) > 1:
            compared += pairs(node["oneOf"])
            if compared > MAX_PAIRS:
                n = len(node["oneOf"])
                return "oneOf", path or "/", _ONE_OF_WORK.format(n, pairs(node["oneOf"]), MAX_PAIRS)
            pair = overlapping_branches(node["oneOf"], schema)
            if pair is not None:
                return "oneOf", path or "/", _ONE_OF_OVERLAP.format(*pair)
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            return "allOf", path or "/", "only the first of several allOf schemas would be enforced"
        undefined = _undefined_required(node, several=True)
        if undefined is not None:
            return "required", path or "/", undefined[1]
        repeated = repeatable_count(node)
        if repeated is not None:
            return repeated[0], path or "/", repeated[1]
        written = false_name_written(node, functools.partial(_matching_keys, node))
        if written is not None:
            return written[0], path or "/", written[1]
        named = listed_name_refused(node)
        if named is not None:
            return named[0], path or "/", named[1]
        clash = _pattern_clash(node)
        if clash is not None:
            return "patternProperties", path or "/", clash
        if isinstance(node.get("pattern"), str) and _has_lookaround(node["pattern"]):
            return (
                "pattern",
                path or "/",
                "lookahead and lookbehind assertions ((?=, (?!, (?<=, (?<!) are not enforced",
            )
        untyped = None if _names_schema(path) else _untyped_keyword(node)
        if untyped is not None:
            return untyped, path or "/", _UNTYPED.format(untyped)
        integer = _integer_schema(node)
        if "multipleOf" in node and integer is None:
            return "multipleOf", path or "/", 'multipleOf is enforced only with "type": "integer"'
        bounded = None if integer is None else multiple_refused(integer)
        if bounded is not None:
            return "multipleOf", path or "/", bounded
        refused = None if "enum" in node or "const" in node else _string_rules(node)  # (listed: below)
        if refused is not None:
            return refused[0], path or "/", refused[1]
        broken = broken_keyword(node)
        if broken is not None:
            listed = "enum" if isinstance(node.get("enum"), list) else "const"
            value, key = broken
            why = f"the listed value {json.dumps(value)} breaks {key} beside it, which would not be enforced"
            return listed, path or "/", why
    return None


def _integer_schema(node: dict) -> dict | None:
    """The integer schema multipleOf would be enforced in: the node itself, or its integer branch
    where a list of types is split (type_lists.py: ["integer", "null"] is null or an integer, and
    took multipleOf as well as one integer alone); None where a number would take it too."""
    kinds = node.get("type")
    if kinds == "integer":
        return node
    if isinstance(kinds, list) and "number" not in kinds:
        return type_branch(node, "integer")
    return None


def _draft4_flag(node: dict) -> tuple[str, str] | None:
    """(keyword, why) for a boolean exclusiveMinimum / exclusiveMaximum, draft 4's (and OpenAPI
    3.0's) flag on minimum / maximum: xgrammar refused it as "Value must be a number", naming
    no keyword."""
    for key, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if node.get(key) is False:
            return key, f"{key} is false, draft 4's flag on {bound}; leave it out ({bound} is inclusive)"
        if node.get(key) is True:
            return key, (
                f"{key} is true, draft 4's flag on {bound}; give the bound itself (draft 6 on), "
                f'"{key}": <number> in place of the flag and "{bound}"'
            )
    return None


def _names_schema(path: str) -> bool:
    """Whether the schema at `path` is a propertyNames schema: names are strings, so xgrammar
    enforces a pattern or length there with no type."""
    *parent, last = path.split("/")
    return last == "propertyNames" and (not parent or parent[-1] not in _SCHEMA_MAPS)


def _untyped_keyword(node: dict) -> str | None:
    """The first keyword of _TYPED_ONLY in a schema with no type to enforce it beside (listed
    values are checked against such keywords in listed_values.py; items make it an array)."""
    if "type" in node or "enum" in node or "const" in node:
        return None
    for key in _TYPED_ONLY:
        if key in node and not (key == "format" and node[key] not in ENFORCED_FORMATS):
            if key in ("minItems", "maxItems") and ("items" in node or "prefixItems" in node):
                continue
            return key
    return None


def unsatisfiable(schema: Any) -> tuple[str, str, str] | None:
    """(keyword, JSON pointer of its schema, why) of a schema closed by its own `false` that
    asks for more names or items than it lists (xgrammar's own message said "aren't allowed")."""
    for path, node in _subschemas(schema, ""):
        found = required_false(node) or closed_too_small(node) or _undefined_required(node, several=False)
        found = found or empty_range(node)
        if found is not None:
            return found[0], path or "/", found[1]
    return None


def _string_rules(node: dict) -> tuple[str, str] | None:
    """(keyword, why) when a string schema combines rules xgrammar enforces only one of: a
    format it knows wins over a pattern and length bounds, a pattern over length bounds (a
    bound the pattern implies, as {2} implies maxLength 2, is kept)."""
    bounds = [k for k in ("minLength", "maxLength") if k in node]
    pattern = node.get("pattern") if isinstance(node.get("pattern"), str) else None
    if node.get("format") in ENFORCED_FORMATS and (pattern is not None or bounds):
        beside = "pattern" if pattern is not None else bounds[0]
        return "format", f"a format is enforced alone: the {beside} beside it would not be"
    if pattern is not None and bounds and not _pattern_implies(pattern, node):
        return bounds[0], f"{bounds[0]} beside a pattern is not enforced unless the pattern implies it"
    return None


def _pattern_implies(pattern: str, node: dict) -> bool:
    """Whether every string the pattern matches already meets the node's length bounds (by
    Python's parse of the regex: its shortest and longest match; False if it cannot say)."""
    try:
        low, high = re._parser.parse(pattern).getwidth()
    except (re.error, AttributeError, OverflowError, RecursionError, ValueError):
        return False
    lo, hi = node.get("minLength", 0), node.get("maxLength")
    return isinstance(lo, int) and low >= lo and (hi is None or (isinstance(hi, int) and high <= hi))


def _undefined_required(node: dict, several: bool) -> tuple[str, str] | None:
    """("required", why) for a required name `properties` lacks and pattern_required.py cannot
    make a property: with `several`, one several patterns with unlike schemas match (its value
    would need all of them at once); else one nothing allows (additionalProperties false)."""
    required, props = node.get("required"), node.get("properties")
    if not isinstance(required, list):
        return None
    props = props if isinstance(props, dict) else {}
    for name in required:
        if not isinstance(name, str) or name in props or required_name_schema(node, name) is not None:
            continue
        if several and len(_patterns_of(node, name)) > 1:
            return "required", (
                f"the required property {name!r} matches several patternProperties patterns, whose schemas "
                "would all apply to its value, which is not enforced; define it under properties"
            )
        if not several and not _patterns_of(node, name):
            return "required", (
                f"the required property {name!r} is not defined in properties and additionalProperties is "
                "false: no object meets it"
            )
    return None


def required_name_schema(node: dict, name: str) -> Any:
    """The schema of a required `name` that `properties` lacks, as JSON Schema gives it: the
    matching patterns' (one, or several alike), else additionalProperties' ({} where it is
    missing or true); None where none can be written (false, or unlike patterns)."""
    patterns = _patterns_of(node, name)
    if patterns:
        first = patterns[0]
        return first if all(p == first for p in patterns) else None
    extra = node.get("additionalProperties", node.get("unevaluatedProperties", True))
    if extra is True:
        return {}
    return extra if isinstance(extra, dict) else None


def _matching_keys(node: dict, name: str) -> list[str]:
    patterns = node.get("patternProperties") if isinstance(node.get("patternProperties"), dict) else {}
    return matching_patterns(patterns, name)


def _patterns_of(node: dict, name: str) -> list:
    patterns = node.get("patternProperties") if isinstance(node.get("patternProperties"), dict) else {}
    return [patterns[p] for p in matching_patterns(patterns, name)]


def _pattern_clash(node: dict) -> str | None:
    """Why a name's value would need two unlike schemas at once, of which xgrammar enforces
    one: a property a pattern also matches, or a name that two patterns can both match
    (pattern_overlap.py). A pattern whose schema is alike or takes any value clashes with none."""
    patterns = node.get("patternProperties")
    if not isinstance(patterns, dict):
        return None
    props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    for name, schema in props.items():
        for pattern in matching_patterns(patterns, name):
            if not _implied(patterns[pattern], schema):
                return (
                    f"the property {name!r} matches the pattern {pattern!r} too, so its value must meet both "
                    "schemas, which is not enforced; make them alike or the pattern not match the name"
                )
    for full, schema in patterns.items():
        for other, beside in patterns.items():
            if other != full and not _implied(beside, schema) and may_overlap(full, other):
                return (
                    f"a name may match both patterns {full!r} and {other!r}, so its value must meet both "
                    "schemas, which is not enforced; make the patterns exclusive or the schemas alike"
                )
    return None


def _implied(schema: Any, given: Any) -> bool:
    """Whether a value meeting `given` surely meets `schema` too (alike, or any value)."""
    return schema in ({}, True) or schema == given


def matching_patterns(patterns: dict, name: str) -> list[str]:
    """The patternProperties keys whose regex finds `name` (JSON Schema's patterns are not
    anchored)."""
    found = []
    for pattern in patterns:
        try:
            if re.search(pattern, name) is not None:
                found.append(pattern)
        except (re.error, TypeError):
            pass
    return found


def _has_lookaround(pattern: str) -> bool:
    """Whether a regex holds a lookaround group; escaped characters and [...] classes, where
    `(?=` is literal text, are skipped. xgrammar drops such a group with a log warning."""
    i, in_class = 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            if pattern.startswith("]", i + 1) or pattern.startswith("^]", i + 1):  # a literal ] first
                i += 2 if pattern[i + 1] == "]" else 3
                continue
        elif pattern.startswith(("(?=", "(?!", "(?<=", "(?<!"), i):
            return True
        i += 1
    return False


def _subschemas(node: Any, path: str) -> Iterator[tuple[str, dict]]:
    """Every schema object inside `node` (keywords' values, not property names), with its path."""
    if not isinstance(node, dict):
        return
    yield path, node
    for key in _ONE_SCHEMA:
        if isinstance(node.get(key), dict):
            yield from _subschemas(node[key], f"{path}/{key}")
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            for i, sub in enumerate(node[key]):
                yield from _subschemas(sub, f"{path}/{key}/{i}")
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                yield from _subschemas(sub, f"{path}/{key}/{name}")
