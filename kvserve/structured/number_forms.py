"""Integers and bounded numbers written by number_ranges.py, not by xgrammar.

xgrammar 0.2.8 writes a number with a bound as its decimal digits only, through 64-bit integers
and six decimal places: `-0` (a JSON number equal to 0) was refused wherever 0 is allowed, and
so was `1e0` and every other exponent; an integer refused `-0` even without bounds, and a bound
past int64 with its own message (number_ranges.py says the rest). Each such number schema is
swapped for a placeholder before xgrammar converts the schema, and the placeholder's literal
for number_ranges.py's exact grammar of it after (for a schema whose bounds are none
it can write, xgrammar's own grammar with `-0` and a zero exponent, as before).
"""

from __future__ import annotations

import json
import re
from typing import Any

from kvserve.structured.integer_bounds import whole_range
from kvserve.structured.number_ranges import number_ebnf, schema_bounds
from kvserve.structured.schema_walk import rebuilt_children

_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_OTHER = ("enum", "const", "anyOf", "oneOf", "allOf", "$ref", "multipleOf", "not", "if")  # left as they are
_RULE = re.compile(r"^([A-Za-z_]\w*) ::=", re.MULTILINE)
_ZERO_EXPONENT = '([eE] [+\\-]? "0"+)'


def swap_numbers(node: Any, numbers: list[dict]) -> Any:
    """The schema with each number schema this module rewrites (an integer, a number with a
    bound) replaced by a placeholder const number (the schema appended to `numbers`)."""
    if isinstance(node, dict) and _rewritten(node):
        numbers.append(node)
        return {"const": _placeholder(len(numbers) - 1)}
    return rebuilt_children(node, lambda v: swap_numbers(v, numbers))


def with_numbers(ebnf: str, numbers: list[dict]) -> str:
    """The EBNF with each placeholder's literal as its number's forms (one xgrammar left out,
    as in an unused $defs schema, is skipped); ValueError when a placeholder is left in
    another spelling."""
    import xgrammar as xgr

    for i, schema in enumerate(numbers):
        literal = f'"{_placeholder(i)}"'
        if str(_placeholder(i)) in ebnf.replace(literal, ""):
            raise ValueError(f"number {i} is not where it was expected")
        if literal not in ebnf:
            continue
        prefix = f"kvserve_number{i}_"
        while re.search(rf"^{prefix}", ebnf, re.MULTILINE):
            prefix += "_"
        exact = _exact(schema)
        if exact is not None:
            ebnf = ebnf.replace(literal, f"{prefix}root") + f"\n{prefix}root ::= {exact}\n"
            continue
        own = _reachable(str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)))
        names = _RULE.findall(own)
        own = re.sub(r"\b(" + "|".join(map(re.escape, names)) + r")\b", prefix + r"\1", own)
        number = schema.get("type") == "number"
        forms = [f"{prefix}root {_ZERO_EXPONENT}?" if number else f"{prefix}root"]
        if _zero_allowed(schema):
            forms.append(f'"-0" ("." "0"+)? {_ZERO_EXPONENT}?' if number else '"-0"')
        ebnf = ebnf.replace(literal, "(" + " | ".join(f"({f})" for f in forms) + ")") + "\n" + own + "\n"
    return ebnf


def empty_range(node: Any) -> tuple[str, str] | None:
    """(keyword, why) for an integer or number schema written here whose bounds leave no value
    (`{"type": "integer", "exclusiveMinimum": 0.12, "exclusiveMaximum": 1}`): its placeholder hid
    the bounds from the check's xgrammar conversion, so it passed, and its compile then failed in
    the engine, the request ending with no answer (finish_reason "abort")."""
    if isinstance(node, dict) and isinstance(node.get("type"), list) and node["type"]:
        kinds = node["type"]  # each type a number: empty when each is (type_lists.py splits the others)
        found = [empty_range({**node, "type": k}) if k in ("integer", "number") else None for k in kinds]
        return found[0] if all(found) else None
    if not isinstance(node, dict) or not _rewritten(node):
        return None
    integer = node.get("type") == "integer"
    if integer:
        low, high = whole_range(node)
        if low is None or high is None or low <= high:
            return None
    elif _exact(node) is not None or schema_bounds(node) is None:
        return None
    low_key = _tightest(node, ("minimum", "exclusiveMinimum"), lower=True)
    high_key = _tightest(node, ("maximum", "exclusiveMaximum"), lower=False)
    said = [f"{_WORDS[k]} {json.dumps(node[k])}" for k in (low_key, high_key) if k is not None]
    why = f"no {'integer' if integer else 'number'} is {' and '.join(said)}"
    low, high = (None, None) if integer else schema_bounds(node)
    if low is not None and high is not None and (low.value, not low.inclusive) < (high.value, high.inclusive):
        why += " that a double reads as itself (clients read a JSON number as a double)"
    return high_key or low_key or "type", why


_WORDS = {
    "minimum": "at least", "exclusiveMinimum": "above", "maximum": "at most", "exclusiveMaximum": "below"
}  # fmt: skip


def _tightest(node: dict, keys: tuple[str, str], lower: bool) -> str | None:
    """Of an inclusive and an exclusive bound on one side, the keyword of the one that binds."""
    inclusive, exclusive = (k if k in node else None for k in keys)
    if inclusive is None or exclusive is None:
        return inclusive or exclusive
    if node[inclusive] == node[exclusive]:
        return exclusive
    return inclusive if (node[inclusive] > node[exclusive]) == lower else exclusive


def _exact(schema: dict) -> str | None:
    """number_ranges.py's expression of a swapped schema, or None where it cannot write it."""
    bounds = schema_bounds(schema, doubles=schema.get("type") == "number")
    if bounds is None:
        return None
    return number_ebnf(schema.get("type") == "integer", *bounds)


def _reachable(ebnf: str) -> str:
    """The rules root reaches (xgrammar writes every basic_* rule into each grammar: a schema
    with hundreds of numbers grew its grammar threefold)."""
    rules = dict(line.split(" ::= ", 1) for line in ebnf.splitlines() if " ::= " in line)
    kept, todo = {"root"}, ["root"]
    while todo:
        for name in re.findall(r"[A-Za-z_]\w*", rules.get(todo.pop(), "")):
            if name in rules and name not in kept:
                kept.add(name)
                todo.append(name)
    return "\n".join(f"{name} ::= {body}" for name, body in rules.items() if name in kept)


def _rewritten(node: dict) -> bool:
    kind = node.get("type")
    if kind not in ("integer", "number") or any(k in node for k in _OTHER):
        return False
    bounds = [node[k] for k in _BOUNDS if k in node]
    if not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in bounds):
        return False  # draft 4's boolean exclusive bounds, or no number: as xgrammar has it
    return kind == "integer" or bool(bounds)


def _zero_allowed(node: dict) -> bool:
    low, high = node.get("minimum"), node.get("maximum")
    low_x, high_x = node.get("exclusiveMinimum"), node.get("exclusiveMaximum")
    return (
        (low is None or low <= 0) and (high is None or high >= 0)
        and (low_x is None or low_x < 0) and (high_x is None or high_x > 0)
    )  # fmt: skip


def _placeholder(i: int) -> int:
    """A number, not a string: xgrammar sees a oneOf branch of it apart from a string branch
    (a string placeholder beside {"type": "string"} had it warn of overlapping branches)."""
    return -7_919_000_000_123 - i
