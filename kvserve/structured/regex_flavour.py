"""A regex as its flavour reads it, written in the syntax xgrammar 0.2.8 reads alike.

A JSON schema's `pattern` (and a patternProperties or propertyNames key) is an ECMA-262 regex,
whose `.` matches no line terminator (LF, CR, U+2028, U+2029); a `regex` constraint has
Python's `re` semantics (vLLM's), whose `.` matches anything but LF. xgrammar writes `.` as
every code point, so `^a.b$` let `{"s": "a\\nb"}` through, which the schema refuses. It also
reads Python's anchors `\\A` and `\\Z` as the letters A and Z (a constraint `\\Afoo\\Z` answered
"AfooZ", which the regex refuses) and `\\x` with every hex digit that follows (`\\x41b`, "Ab"
in both flavours, was U+041B). Each is written as what it means before xgrammar reads the
regex: `.` outside a class as the class it stands for, `\\A` / `\\Z` as `^` / `$` (Python only:
ECMA-262 reads them as letters too), `\\xhh` as `\\u00hh`, a Python octal escape (`\\012`, a
newline: xgrammar refused it as a backreference) as `\\u000a`, and `\\s` / `\\S` as the flavour's
spaces (xgrammar's are ASCII's and U+00A0: ECMA-262's U+2003 or U+3000, Python's U+0085 were
refused) or all else.

xgrammar writes a NUL character (`\\0`, `\\x00`, `\\u0000`) standing alone, or a class of it
alone, as the empty string: `a\\0b` answered "ab". A class holding NUL and another character is
kept, so NUL is written beside a lone surrogate (`[\\0\\ud800]`), which json_patterns.py drops
from every class (no UTF-8 text holds one).
"""

from __future__ import annotations

import re

ECMA_DOT = r"[^\n\r\u2028\u2029]"
# ECMA-262's \s: its WhiteSpace (with every Unicode space separator) and LineTerminator
ECMA_SPACES = ((0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029),
               (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF))  # fmt: skip
# Python's \s in a str pattern: what str.isspace() takes (no U+FEFF; U+001C-U+001F and U+0085)
PYTHON_SPACES = ((0x09, 0x0D), (0x1C, 0x20), (0x85, 0x85), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
                 (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000))  # fmt: skip
_TOP = 0x10FFFF
PYTHON_DOT = r"[^\n]"
_HEX = frozenset("0123456789abcdefABCDEF")
_SURROGATE = "\\ud800"  # kept beside NUL so xgrammar keeps the class (json_patterns.py drops it)
# NUL in both flavours (ECMA's \0 is NUL only when no digit follows; Python's \0, \00, \000 are).
_NUL = {True: re.compile(r"\\(?:0{1,3}(?![0-7])|x00|u0000|U00000000)"),
        False: re.compile(r"\\(?:0(?![0-9])|x00|u0000)")}  # fmt: skip
# Python's octal escapes: outside a class \0, \0o, \0oo or three digits (\1 or \12 is a group
# reference there); inside a class one to three digits.
_OCTAL = {False: re.compile(r"\\(0[0-7]{0,2}|[0-3][0-7]{2})"), True: re.compile(r"\\([0-7]{1,3})")}


def for_xgrammar(pattern: str, python: bool) -> str:
    """`pattern` (Python's flavour, else ECMA-262's) with its dots and anchors outside classes,
    its `\\x` escapes and its NUL characters written as above. A class ends at its first
    unescaped `]`, as xgrammar reads it (`[]` is empty)."""
    out, i, in_class, nul_in_class = [], 0, False, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            octal = _OCTAL[in_class].match(pattern, i) if python else None
            if octal is not None and int(octal.group(1), 8) not in (0, *range(0o400, 0o1000)):
                out.append(f"\\u{int(octal.group(1), 8):04x}")
                i = octal.end()
                continue
            nul = _NUL[python].match(pattern, i)
            if nul is not None:
                out.append("\\0" if in_class else f"[\\0{_SURROGATE}]")
                nul_in_class |= in_class
                i = nul.end()
                continue
            esc, hexes = pattern[i : i + 2], pattern[i + 2 : i + 4]
            if esc == "\\x" and len(hexes) == 2 and all(h in _HEX for h in hexes):
                out.append("\\u00" + hexes)  # two digits, as both flavours read them
                i += 4
                continue
            if esc in ("\\s", "\\S"):
                ranges = PYTHON_SPACES if python else ECMA_SPACES
                ranges = _ranges_text(ranges if esc == "\\s" else _complement(ranges))
                out.append(ranges if in_class else f"[{ranges}]")
                i += 2
                continue
            if python and not in_class and esc in ("\\A", "\\Z"):
                esc = "^" if esc == "\\A" else "$"
            out.append(esc)
            i += 2
            continue
        if in_class:
            in_class = c != "]"
            if not in_class and nul_in_class:
                out.append(_SURROGATE)
        elif c == "[":
            in_class, nul_in_class = True, False
        elif c == ".":
            c = PYTHON_DOT if python else ECMA_DOT
        out.append(c)
        i += 1
    return "".join(out)


def _complement(ranges: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    out, start = [], 0
    for low, high in ranges:  # sorted, apart
        if low > start:
            out.append((start, low - 1))
        start = high + 1
    return (*out, (start, _TOP)) if start <= _TOP else tuple(out)


def _ranges_text(ranges: tuple[tuple[int, int], ...]) -> str:
    """Ranges as the inside of a class, every code point escaped."""
    esc = lambda cp: f"\\u{cp:04x}" if cp <= 0xFFFF else f"\\U{cp:08x}"  # noqa: E731
    return "".join(esc(lo) if lo == hi else f"{esc(lo)}-{esc(hi)}" for lo, hi in ranges)
