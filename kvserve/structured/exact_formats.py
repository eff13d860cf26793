"""String formats xgrammar writes too loosely, rewritten as exact patterns.

xgrammar 0.2.8 writes `format: date` as any month 01-12 and any day 01-31, so `2024-04-31`,
`2023-02-30` and `2023-02-29` were answered though no such day exists (RFC 3339's full-date
bounds the day by month and year); `date-time` shares that date and took only an upper-case
`T` and `Z`, which RFC 3339 allows in lower case too; `ipv4` took an octet's leading zeros
(`01.2.3.4`), which RFC 2673's dotted-decimal form, and JSON Schema's format tests, refuse.
Each is swapped for a pattern that says exactly what the format does (a string schema only:
a format beside a pattern or a length bound is refused in schema_support.py).
"""

from __future__ import annotations

from typing import Any

from kvserve.structured.schema_walk import rebuilt_children

_DAY_31 = "(0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])"
_DAY_30 = "(0[469]|11)-(0[1-9]|[12][0-9]|30)"
_DAY_28 = "02-(0[1-9]|1[0-9]|2[0-8])"
# Gregorian leap years: divisible by 4, but not by 100 unless by 400.
_LEAP_YEAR = "([0-9]{2}(0[48]|[2468][048]|[13579][26])|([02468][048]|[13579][26])00)"
DATE = f"([0-9]{{4}}-({_DAY_31}|{_DAY_30}|{_DAY_28})|{_LEAP_YEAR}-02-29)"
# RFC 3339 partial-time and time-offset: second 60 is a leap second; "Z" in either case.
TIME = "([01][0-9]|2[0-3]):[0-5][0-9]:([0-5][0-9]|60)(\\.[0-9]+)?([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
EXACT = {
    "date": f"^{DATE}$",
    "date-time": f"^{DATE}[Tt]{TIME}$",
    "time": f"^{TIME}$",
    "ipv4": f"^({_OCTET}\\.){{3}}{_OCTET}$",
}


def exact_formats(node: Any) -> Any:
    """The schema with each string's date, date-time, time or ipv4 format as its exact
    pattern (a listed value's schema, where xgrammar writes the values alone, left as it is)."""
    out = rebuilt_children(node, exact_formats)
    if not isinstance(out, dict) or out.get("type") != "string" or "pattern" in out:
        return out
    fmt = out.get("format")
    if not isinstance(fmt, str) or fmt not in EXACT or "enum" in out or "const" in out:
        return out
    out = {k: v for k, v in out.items() if k != "format"}
    out["pattern"] = EXACT[fmt]
    return out
