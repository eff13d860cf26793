"""An integer's bounds as whole numbers, and its multipleOf beside them as the list of multiples.

xgrammar 0.2.8 refuses an integer bound that is not whole (`{"type": "integer", "minimum":
1.5}`, valid JSON Schema that 2 meets) with its own message, "Integer constraint must be a whole
number"; such a bound is written as the whole one it means (a minimum of 1.5 is 2, an exclusive
maximum of 2.5 is a maximum of 2). It also drops multipleOf beside any bound, with only a log
warning, where the bounds are one-sided or 10,000 or more apart, so `{"type": "integer",
"multipleOf": 3, "minimum": 0}` was answered 4. Where both bounds leave at most MAX_MULTIPLES
multiples, such a schema is written as their enum; elsewhere schema_support.py refuses it
(`multiple_refused`). A multipleOf above 1024 xgrammar drops whatever the bounds (3 answered
`"multipleOf": 2000`): it is listed likewise between bounds, and refused without them. A
multipleOf that is not whole, which xgrammar drops on an integer (2 was an answer to
`"multipleOf": 2.5`), is written as the whole one it means for integers: the numerator of its
lowest terms (a whole multiple of 5/2 is a multiple of 5; of 0.5, any integer).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

from kvserve.structured.json_numbers import finite_number
from kvserve.structured.schema_walk import rebuilt_children

MAX_MULTIPLES = 1024
XGRAMMAR_SPAN = 10_000  # xgrammar enforces multipleOf itself where maximum - minimum is below this
XGRAMMAR_STEP = 1024  # and where multipleOf is at most this: a larger one it drops (3 answered 2000)
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def whole_integers(node: Any) -> Any:
    """The schema with each integer's bounds whole and its bounded multipleOf as an enum."""
    out = whole_step(rebuilt_children(node, whole_integers))
    if not _is_integer_schema(out):
        return out
    low, high = whole_range(out)
    listed = _multiples(out, low, high)
    out = {k: v for k, v in out.items() if k not in _BOUNDS}
    if listed is not None:
        out = {k: v for k, v in out.items() if k != "multipleOf"}
        out["enum"] = listed
        return out
    if low is not None:
        out["minimum"] = low
    if high is not None:
        out["maximum"] = high
    return out


def multiple_refused(node: dict) -> str | None:
    """Why an integer's multipleOf cannot be enforced (beside a bound, or above XGRAMMAR_STEP), or
    None."""
    node = whole_step(node)
    step = node.get("multipleOf") if isinstance(node, dict) else None
    if not _is_integer_schema(node) or not _number(step):
        large = _number(step) and step > XGRAMMAR_STEP and node.get("type") == "integer"
        if large and not any(k in node for k in (*_BOUNDS, "enum", "const")):
            return (
                f"a multipleOf above {XGRAMMAR_STEP} is enforced only between a minimum and a maximum that "
                f"hold at most {MAX_MULTIPLES} multiples (written as their list)"
            )
        return None
    if not any(_number(node.get(k)) for k in _BOUNDS):
        return None
    low, high = whole_range(node)
    listed = _multiples(node, low, high)
    if listed == []:
        return f"no multiple of {step} is within the bounds beside it (from {low} to {high})"
    if listed:
        return None
    if low is not None and high is not None and high - low < XGRAMMAR_SPAN and step <= XGRAMMAR_STEP:
        if _int64(low) and _int64(high):
            return None
        return (
            "a whole multipleOf beside bounds past 64-bit integers is enforced only where they hold at most "
            f"{MAX_MULTIPLES} multiples (written as their list)"
        )
    return (
        "a whole multipleOf beside a bound is enforced only where minimum and maximum are less than "
        f"{XGRAMMAR_SPAN} apart or hold at most {MAX_MULTIPLES} multiples (written as their list)"
    )


def whole_step(node: Any) -> Any:
    """An integer schema with a multipleOf that is not whole given the whole one it means for
    integers (left out where that is 1); any other node as it is."""
    if not isinstance(node, dict) or node.get("type") != "integer" or "enum" in node or "const" in node:
        return node
    step = node.get("multipleOf")
    if not _number(step) or step <= 0 or step % 1 == 0:
        return node
    whole = Fraction(repr(step)).numerator  # the decimal the client wrote (a float's shortest repr)
    out = {k: v for k, v in node.items() if k != "multipleOf"}
    return out if whole == 1 else {**out, "multipleOf": whole}


def whole_range(node: dict) -> tuple[int | None, int | None]:
    """The least and greatest integers the bounds allow (None: unbounded)."""
    lows, highs = [], []
    for key, exclusive in (("minimum", False), ("exclusiveMinimum", True)):
        if _number(v := node.get(key)):
            lows.append(math.floor(v) + 1 if exclusive else math.ceil(v))
    for key, exclusive in (("maximum", False), ("exclusiveMaximum", True)):
        if _number(v := node.get(key)):
            highs.append(math.ceil(v) - 1 if exclusive else math.floor(v))
    return (max(lows) if lows else None), (min(highs) if highs else None)


def _multiples(node: dict, low: int | None, high: int | None) -> list[int] | None:
    """The multiples of a whole multipleOf within [low, high] where xgrammar would drop it: 0 to
    MAX_MULTIPLES of them, else None."""
    step = node.get("multipleOf")
    if not _number(step) or step <= 0 or step % 1 != 0 or low is None or high is None:
        return None
    if high - low < XGRAMMAR_SPAN and _int64(low) and _int64(high) and step <= XGRAMMAR_STEP:
        return None  # left to xgrammar
    step = int(step)
    first = -(-low // step) * step
    if first <= high and (high - first) // step + 1 > MAX_MULTIPLES:
        return None
    return list(range(first, high + 1, step))  # (empty: no multiple within the bounds)


def _int64(v: int) -> bool:
    """Whether xgrammar can hold the bound (it refuses others: "Integer exceeds maximum limit")."""
    return -(2**63) <= v < 2**63


def _is_integer_schema(node: Any) -> bool:
    """An integer schema with bounds, each a finite number (a draft-4 boolean exclusiveMinimum
    is left to xgrammar, as before)."""
    if not isinstance(node, dict) or node.get("type") != "integer" or "enum" in node or "const" in node:
        return False
    bounds = [node[k] for k in _BOUNDS if k in node]
    return bool(bounds) and all(_number(v) for v in bounds)


def _number(v: Any) -> bool:
    return finite_number(v)
