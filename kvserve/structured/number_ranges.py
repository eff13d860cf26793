"""A bounded JSON number's or integer's grammar, exact for bounds of any size and digits of any count.

xgrammar 0.2.8 writes a bounded number through 64-bit integers and six decimal places: an integer
bound past int64 (`"minimum": -1e20`) was refused in its words ("Integer exceeds minimum limit"),
a number's integer part stopped at 2**63 (under `"maximum": 1e30`, 10**20 was refused and 1e30
itself only as the double's 31 digits), its fraction at six digits (0.3333333 refused under
`"maximum": 1`) and every exponent refused. Here a bound is an exact decimal (a float as its
shortest repr, the text the schema most likely held) and a value is compared with it digit by
digit: a positive number is 0.X x 10**p with X's first digit not 0, so p decides unless it is the
bound's own p, where X is compared with the bound's digits. That covers plain decimals of any
length, any number with a zero exponent (`1.5e0`), and the scientific form with one digit before
the point (`1e30`, `2.5E-3`) whatever its exponent. Other exponent forms (`25e-1`, `0.1e2`) stay
refused under a bound: comparing them takes adding the exponent to the count of integer digits,
which no grammar of bounded size can do. Most clients read a JSON number as a double: `1e-400`
under `"exclusiveMinimum": 0` read as 0, breaking the bound, and `1e400` under `"maximum": 1e308`
as infinity; where 0 is out of bounds a magnitude is at least 1e-307, and under a bound at 1e308
or past it, less than 1e308.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal

from kvserve.structured.json_numbers import finite_number

_ANY = "[0-9]*"
_ZERO = '"0"'
_ZEROS = '"0"*'
_FRACTION = '("." [0-9]+)'
_ZERO_FRACTION = '"." "0"+'
_ZERO_EXPONENT = '([eE] [+\\-]? "0"+)'
_EXPONENT = "([eE] [+\\-]? [0-9]+)"
_POSITIVE = f'(([1-9] [0-9]* {_FRACTION}?) | ("0" "." "0"* [1-9] [0-9]*)) {_EXPONENT}?'


@dataclass(frozen=True)
class Bound:
    value: Decimal
    inclusive: bool


# The magnitudes a double reads as a number near themselves: not 0 (below the normal range), not
# infinity (1.8e308 and more), with room to spare.
_TINY = Bound(Decimal("1e-307"), True)
_HUGE = Bound(Decimal("1e308"), False)
_EXACT_INTS = 2**53  # an integer bound below it is a double exactly; past it left as written


def schema_bounds(schema: dict, doubles: bool = False) -> tuple[Bound | None, Bound | None] | None:
    """(low, high) of a number schema's finite bounds, the tighter of each pair; None when a
    bound is no finite number. With `doubles`, an exclusive bound other than 0 is the inclusive
    one at the next double past it: a client reads an answer as a double, and one past the bound
    by less than that (0.50000000000000001 over exclusiveMinimum 0.5) reads as the bound itself,
    which it must exceed."""
    low = high = None
    for key, is_low, inclusive in (("minimum", True, True), ("exclusiveMinimum", True, False),
                                   ("maximum", False, True), ("exclusiveMaximum", False, False)):  # fmt: skip
        v = schema.get(key)
        if v is None:
            continue
        if not finite_number(v):
            return None
        b = Bound(Decimal(v) if isinstance(v, int) else Decimal(repr(v)), inclusive)
        if doubles and not inclusive and v != 0 and abs(v) < _EXACT_INTS:
            b = Bound(Decimal(repr(math.nextafter(float(v), math.inf if is_low else -math.inf))), True)
        if is_low and (low is None or (b.value, not b.inclusive) > (low.value, not low.inclusive)):
            low = b
        if not is_low and (high is None or (b.value, b.inclusive) < (high.value, high.inclusive)):
            high = b
    return low, high


def number_ebnf(integer: bool, low: Bound | None, high: Bound | None) -> str | None:
    """The EBNF expression of the JSON numbers (integers: JSON integers, `-0` included) within
    [low, high]; None when none is."""
    alts = []
    zero_in = _within(Decimal(0), low, high)
    if zero_in:
        zero = '"0"' if integer else f'"0" ({_ZERO_FRACTION})? {_EXPONENT}?'
        alts += [zero, f'"-" {zero}']
    if high is None or high.value > 0:
        positive = _as_double(low if low is not None and low.value > 0 else None, high, integer, zero_in)
        alts += _positive(*positive, integer)
    if low is None or low.value < 0:
        neg_low = Bound(-high.value, high.inclusive) if high is not None and high.value < 0 else None
        neg_high = None if low is None else Bound(-low.value, low.inclusive)
        negative = _as_double(neg_low, neg_high, integer, zero_in)
        alts += [f'"-" ({a})' for a in _positive(*negative, integer)]
    return " | ".join(f"({a})" for a in alts) or None


def _as_double(
    low: Bound | None, high: Bound | None, integer: bool, zero: bool
) -> tuple[Bound | None, Bound | None]:
    """A number's bounds on magnitudes (low None or > 0) tightened so that a double reads every
    value within them: at least _TINY where 0 is out of bounds (a smaller one reads as 0), under
    _HUGE where a bound at or past it is set (a larger one reads as infinity). An integer is read
    exactly by clients that read integers: left as it is."""
    if integer:
        return low, high
    if not zero and (low is None or (low.value, not low.inclusive) < (_TINY.value, not _TINY.inclusive)):
        low = _TINY
    if high is not None and (high.value, high.inclusive) > (_HUGE.value, _HUGE.inclusive):
        high = _HUGE
    return low, high


def _within(v: Decimal, low: Bound | None, high: Bound | None) -> bool:
    above = low is None or v > low.value or (v == low.value and low.inclusive)
    return above and (high is None or v < high.value or (v == high.value and high.inclusive))


def _order(v: Decimal) -> tuple[int, str]:
    """(p, X) with v = 0.X x 10**p, X's first and last digits not 0 (v > 0)."""
    sign, digits, exponent = v.normalize().as_tuple()
    return len(digits) + int(exponent), "".join(map(str, digits)).rstrip("0")


def _positive(low: Bound | None, high: Bound | None, integer: bool) -> list[str]:
    """Alternatives for the unsigned numerals of values v > 0 within the bounds (low None or > 0)."""
    if low is not None and high is not None and not _within(low.value, None, high):
        return []
    if low is not None and high is not None and low.value == high.value and not low.inclusive:
        return []
    if low is None and high is None:
        return ["[1-9] [0-9]*"] if integer else [_POSITIVE]
    q_low, d_low = _order(low.value) if low is not None else (None, "")
    q_high, d_high = _order(high.value) if high is not None else (None, "")
    alts = []
    if q_low is not None and q_low == q_high:
        alts += _forms_at(q_low, _between(d_low, d_high, low.inclusive, high.inclusive), integer)
        return alts
    if q_low is not None:
        alts += _forms_at(q_low, (_ge if low.inclusive else _gt)(d_low), integer)
    if q_high is not None:
        alts += _forms_at(q_high, (_le if high.inclusive else _lt)(d_high), integer)
    first = None if q_low is None else q_low + 1
    last = None if q_high is None else q_high - 1
    return alts + _free(first, last, integer)


def _free(first: int | None, last: int | None, integer: bool) -> list[str]:
    """Every numeral whose p is within [first, last] (None: unbounded)."""
    if first is not None and last is not None and first > last:
        return []
    alts = []
    if last is None or last >= 1:
        lo = max(first, 1) if first is not None else 1
        hi = "" if last is None else str(last - 1)
        digits = f"[1-9] [0-9]{{{lo - 1},{hi}}}"
        alts.append(digits if integer else f"{digits} {_FRACTION}? {_ZERO_EXPONENT}?")
    if integer:
        return alts
    if first is None or first <= 0:
        lo = "" if first is None else str(-first)
        hi = 0 if last is None or last >= 0 else -last
        alts.append(f'"0" "." "0"{{{hi},{lo}}} [1-9] [0-9]* {_ZERO_EXPONENT}?')
    low = None if first is None else first - 1
    high = None if last is None else last - 1
    alts.append(f"[1-9] {_FRACTION}? [eE] ({exponent_ebnf(low, high)})")
    return alts


def exponent_ebnf(low: int | None, high: int | None) -> str:
    """An exponent's digits within [low, high]: a sign (`+` too) and leading zeros allowed."""
    alts = []
    if (low is None or low <= 0) and (high is None or high >= 0):
        alts.append('[+\\-]? "0"+')
    if high is None or high > 0:
        lo = None if low is None or low < 1 else Bound(Decimal(low), True)
        hi = None if high is None else Bound(Decimal(high), True)
        alts += [f'"+"? "0"* ({a})' for a in _positive(lo, hi, integer=True)]
    if low is None or low < 0:
        lo = None if high is None or high > -1 else Bound(Decimal(-high), True)
        hi = None if low is None else Bound(Decimal(-low), True)
        alts += [f'"-" "0"* ({a})' for a in _positive(lo, hi, integer=True)]
    return " | ".join(f"({a})" for a in alts)


# ---- digit strings X compared with a bound's digits D as 0.X with 0.D ------------------------
# A node: ("end",) X ends here; ("seq", digit class, node); ("alt", [nodes]); ("any",) ("zeros",)
# ("nonzero",) for the digits left: any, only zeros, at least one not zero. None: no X.


def _alt(*nodes):
    kept = [n for n in nodes if n is not None]
    return None if not kept else kept[0] if len(kept) == 1 else ("alt", kept)


def _seq(cls: str | None, node):
    return None if cls is None or node is None else ("seq", cls, node)


def _cls(lo: int, hi: int) -> str | None:
    return None if lo > hi else f'"{lo}"' if lo == hi else f"[{lo}-{hi}]"


def _le(d: str):
    if not d:
        return ("zeros",)
    r = int(d[0])
    return _alt(("end",), _seq(_cls(0, r - 1), ("any",)), _seq(_cls(r, r), _le(d[1:])))


def _lt(d: str):
    if not d.rstrip("0"):
        return None
    r = int(d[0])
    return _alt(("end",), _seq(_cls(0, r - 1), ("any",)), _seq(_cls(r, r), _lt(d[1:])))


def _ge(d: str):
    if not d.rstrip("0"):
        return ("any",)
    r = int(d[0])
    return _alt(_seq(_cls(r + 1, 9), ("any",)), _seq(_cls(r, r), _ge(d[1:])))


def _gt(d: str):
    if not d.rstrip("0"):
        return ("nonzero",)
    r = int(d[0])
    return _alt(_seq(_cls(r + 1, 9), ("any",)), _seq(_cls(r, r), _gt(d[1:])))


def _between(a: str, b: str, a_inclusive: bool, b_inclusive: bool):
    """X with A <= X <= B (as 0.X; strict where not inclusive), A <= B (A = B: both inclusive)."""
    if a == b:
        node = ("zeros",)
        for digit in reversed(a):
            node = _seq(f'"{digit}"', node)
        return node
    n = max(len(a), len(b))
    a, b = a.ljust(n, "0"), b.ljust(n, "0")
    i = next(k for k in range(n) if a[k] != b[k])
    x, y = int(a[i]), int(b[i])
    ends = a_inclusive and not a[i:].rstrip("0")  # X = A's digits, then only zeros
    node = _alt(
        ("end",) if ends else None,
        _seq(_cls(x, x), (_ge if a_inclusive else _gt)(a[i + 1 :])),
        _seq(_cls(x + 1, y - 1), ("any",)),
        _seq(_cls(y, y), (_le if b_inclusive else _lt)(b[i + 1 :])),
    )
    for k in range(i - 1, -1, -1):
        node = _seq(_cls(int(a[k]), int(a[k])), node)
        if a_inclusive and not a[k:].rstrip("0"):
            node = _alt(("end",), node)
    return node


def _first_not_zero(node):
    """The node with its first digit 1-9 (X's first digit)."""
    kind = node[0]
    if kind == "alt":
        return _alt(*(_first_not_zero(n) for n in node[1]))
    if kind == "seq":
        return None if node[1] == '"0"' else _seq(node[1].replace("[0-", "[1-"), node[2])
    if kind in ("any", "nonzero"):
        return ("seq", "[1-9]", ("any",))
    return None  # end, zeros


def _forms_at(p: int, node, integer: bool) -> list[str]:
    """The numerals of 0.X x 10**p for X in node: plain (p integer digits) and scientific."""
    node = None if node is None else _first_not_zero(node)
    if node is None:
        return []
    alts = []
    if p >= 1:
        plain = _render(node, p, integer)
        if plain is not None:
            alts.append(plain if integer else f"{plain} {_ZERO_EXPONENT}?")
    elif not integer:
        plain = _render(node, 0, False, placed=True)
        if plain is not None:
            alts.append(f'"0" "." {_times(_ZERO, -p)} {plain} {_ZERO_EXPONENT}?')
    if not integer:
        mantissa = _render(node, 1, False)
        if mantissa is not None:
            alts.append(f"{mantissa} [eE] ({exponent_ebnf(p - 1, p - 1)})")
    return alts


def _times(item: str, n: int) -> str:
    return "" if n == 0 else item if n == 1 else f"{item}{{{n}}}"


def _join(parts: list[str]) -> str | None:
    return "(" + " | ".join(f"({r})" if r.strip() else '""' for r in parts) + ")" if parts else None


def _render(node, t: int, integer: bool, placed: bool = False) -> str | None:
    """The EBNF of X's digits with the point after t more of them (an integer's X ends there);
    placed: the point is behind."""
    kind = node[0]
    if kind == "alt":
        return _join([r for n in node[1] if (r := _render(n, t, integer, placed)) is not None])
    if kind == "end":
        return "" if t == 0 else None
    if kind == "seq":
        if t == 0 and integer:
            return None
        rest = _render(node[2], max(t - 1, 0), integer, placed or t == 0)
        point = '"." ' if t == 0 and not placed else ""  # a digit past the integer part
        return None if rest is None else f"{point}{node[1]} {rest}".strip()
    if placed:
        return {"any": _ANY, "zeros": _ZEROS, "nonzero": '"0"* [1-9] [0-9]*'}[kind]
    if kind == "any":
        return f"{_times('[0-9]', t)} {'' if integer else _FRACTION + '?'}".strip()
    if kind == "zeros":
        return f"{_times(_ZERO, t)} {'' if integer else f'({_ZERO_FRACTION})?'}".strip()
    fraction = "" if integer else f" {_FRACTION}?"
    alts = [f"{_times(_ZERO, j)} [1-9] {_times('[0-9]', t - j - 1)}{fraction}" for j in range(t)]
    if not integer:
        alts.append(f'{_times(_ZERO, t)} "." "0"* [1-9] [0-9]*')
    return _join(alts)
