"""String formats xgrammar writes too loosely, rewritten as exact patterns.

xgrammar 0.2.8 writes `format: date` as any month 01-12 and any day 01-31, so `2024-04-31`,
`2023-02-30` and `2023-02-29` were answered though no such day exists (RFC 3339's full-date
bounds the day by month and year); `date-time` shares that date and took only an upper-case
`T` and `Z`, which RFC 3339 allows in lower case too; `ipv4` took an octet's leading zeros
(`01.2.3.4`), which RFC 2673's dotted-decimal form, and JSON Schema's format tests, refuse, and
so did `ipv6`'s embedded IPv4 address, whose other forms it partly refused (`1::2:3.4.5.6`);
`hostname` took labels past 63 characters (RFC 1123) and names of any length: its pattern here is
what the 400 check reads, while the compile writes hostname.py's grammar, which bounds the name too.
Each is swapped for a pattern that says exactly what the format does (a string schema only:
a format beside a pattern or a length bound is refused in schema_support.py).
"""

from __future__ import annotations

from typing import Any

from kvserve.structured.hostname import PATTERN as HOSTNAME
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
IPV4 = f"({_OCTET}\\.){{3}}{_OCTET}"
_H16 = "[0-9A-Fa-f]{1,4}"
_LS32 = f"({_H16}:{_H16}|{IPV4})"


def _ipv6() -> str:
    """RFC 3986's IPv6address: eight 16-bit pieces, or fewer around one "::" (which stands for at
    least one); the last 32 bits may be an IPv4 address."""
    forms = [f"({_H16}:){{6}}{_LS32}", f"::({_H16}:){{5}}{_LS32}"]
    # (pieces "h16:" after "::" before the last 32 bits, or -1: one h16 ends it; most before "::")
    for after, most in ((4, 1), (3, 2), (2, 3), (1, 4), (0, 5), (-1, 6), (None, 7)):
        before = f"(({_H16}:){{0,{most - 1}}}{_H16})?"
        tail = "" if after is None else _H16 if after < 0 else f"({_H16}:){{{after}}}{_LS32}"
        forms.append(f"{before}::{tail}")
    return "(" + "|".join(forms) + ")"


EXACT = {
    "date": f"^{DATE}$",
    "date-time": f"^{DATE}[Tt]{TIME}$",
    "time": f"^{TIME}$",
    "ipv4": f"^{IPV4}$",
    "ipv6": f"^{_ipv6()}$",
    "hostname": HOSTNAME,
}


def exact_formats(node: Any) -> Any:
    """The schema with each string's date, date-time, time, ipv4, ipv6 or hostname format as its exact
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
