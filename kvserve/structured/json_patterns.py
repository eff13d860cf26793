"""Regex grammars respelt: a JSON schema's string `pattern` (or a key's) over the string's JSON
text, and a regex constraint's classes without surrogates.

xgrammar 0.2.8 writes a pattern either as a regex whose classes leave out a quote, a backslash
and control characters (a value holding one, e.g. 'say "hi"' for `^.+$`, was unreachable) or,
for some patterns, as the regex's raw characters (`.` let a bare quote or newline into the
output, and `a"b` was written unescaped: text json.loads refuses). Here the pattern's own
grammar (xgrammar's regex conversion, over characters) has each terminal rewritten to the
characters' JSON spelling: a quote, a backslash or a control character escaped, any other
character as itself. No class keeps a surrogate (U+D800-U+DFFF): their 3-byte forms are no
UTF-8, and decoded each byte became a U+FFFD the pattern never allowed.
"""

from __future__ import annotations

import json
import re

from kvserve.structured.regex_flavour import for_xgrammar

MAX_CODE_POINT = 0x10FFFF
_SURROGATES = (0xD800, 0xDFFF)  # no UTF-8 holds them: a class's characters leave them out
_SPECIAL = [*range(0x20), 0x22, 0x5C]  # what a JSON string holds only escaped
_SIMPLE = {
    "n": "\n",
    "t": "\t",
    "r": "\r",
    "f": "\f",
    "v": "\v",
    "0": "\0",
    "b": "\b",
    "a": "\a",
    "e": "\x1b",
}
_HEX = {"x": 2, "u": 4, "U": 8}


def pattern_grammar(pattern: str, prefix: str) -> str:
    """EBNF rules (the first named `prefix`) matching the JSON text, without its quotes, of
    every string `pattern` matches in full."""
    text = _respelt(pattern, json_text=True)
    return re.sub(r"\broot((?:_\d+)*)\b", lambda m: prefix + m.group(1), text)


def regex_grammar(pattern: str) -> str:
    """EBNF of a regex over plain text (a `regex` constraint): xgrammar's, with no character
    class taking a surrogate, whose 3-byte form is no UTF-8 (`.` and `[^...]` took them)."""
    return _respelt(pattern, json_text=False)


def _respelt(pattern: str, json_text: bool) -> str:
    """xgrammar's grammar of the regex read in its flavour (ECMA-262 for a schema, Python's
    for a regex constraint: regex_flavour.py), each rule's terminals respelt (_terminals)."""
    import xgrammar as xgr

    text = str(xgr.Grammar.from_regex(for_xgrammar(pattern, python=not json_text)))
    return "\n".join(_terminals(line, json_text) for line in text.splitlines() if line.strip())


def _terminals(line: str, json_text: bool) -> str:
    """One rule with every character class (and, for JSON text, string literal) respelt."""
    out, i = [], line.index("::=") + 3
    out.append(line[:i])
    while i < len(line):
        c = line[i]
        if c == '"':
            start = i
            chars, i = _read(line, i + 1, '"')
            out.append(
                _literal(json.dumps("".join(chars), ensure_ascii=False)[1:-1]) if json_text else line[start:i]
            )
        elif c == "[":
            negated = line.startswith("^", i + 1)
            chars, i = _read(line, i + 2 if negated else i + 1, "]", ranges=True)
            ranges = complement(chars) if negated else chars
            out.append(_class(ranges) if json_text else _plain_class(ranges))
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _read(line: str, i: int, end: str, ranges: bool = False) -> tuple[list, int]:
    """The characters (or, in a class, (low, high) ranges) up to `end`, and the index past it."""
    items: list = []
    while line[i] != end:
        cp, i = _char(line, i)
        if ranges and line[i] == "-" and line[i + 1] != "]":
            high, i = _char(line, i + 1)
            items.append((cp, high))
        else:
            items.append((cp, cp) if ranges else chr(cp))
    return items, i + 1


def _char(line: str, i: int) -> tuple[int, int]:
    """One (possibly escaped) character of EBNF text: its code point and the index past it."""
    if line[i] != "\\":
        return ord(line[i]), i + 1
    e = line[i + 1]
    if e in _HEX:
        n = _HEX[e]
        return int(line[i + 2 : i + 2 + n], 16), i + 2 + n
    return ord(_SIMPLE.get(e, e)), i + 2


def complement(ranges) -> list[tuple[int, int]]:
    """The code points outside `ranges` (inclusive (low, high) pairs), as sorted ranges."""
    out, start = [], 0
    for low, high in sorted(ranges):
        if low > start:
            out.append((start, low - 1))
        start = max(start, high + 1)
    if start <= MAX_CODE_POINT:
        out.append((start, MAX_CODE_POINT))
    return out


def _class(ranges: list[tuple[int, int]]) -> str:
    """A class of code points as JSON text: the plain ones as a class, the others escaped."""
    special = [cp for cp in _SPECIAL if any(low <= cp <= high for low, high in ranges)]
    plain = complement([(cp, cp) for cp in _SPECIAL] + [_SURROGATES] + complement(ranges))
    alts = [_ranges(plain)] if plain else []
    if all(cp in special for cp in range(0x20)):  # every control: any \u00XX, and the short forms
        special = [cp for cp in special if cp >= 0x20 or json.dumps(chr(cp))[2] != "u"]
        alts.append('"\\\\u00" [01] [0-9a-fA-F]')
    alts += [_literal(json.dumps(chr(cp))[1:-1]) for cp in special]
    return "(" + " | ".join(alts) + ")"


def _literal(text: str) -> str:
    return '"' + "".join(_esc(ord(ch)) for ch in text) + '"'


def _esc(cp: int, also: str = "") -> str:
    """A code point as EBNF text: in a literal (a class escapes `also` too)."""
    if 0x20 <= cp < 0x7F:
        ch = chr(cp)
        return "\\" + ch if ch in '\\"' + also else ch
    return f"\\u{cp:04x}" if cp <= 0xFFFF else f"\\U{cp:08x}"


def _plain_class(ranges: list[tuple[int, int]]) -> str:
    kept = complement([_SURROGATES] + complement(ranges))
    if not kept:
        raise ValueError("a character class of surrogates only")
    return _ranges(kept)


def _ranges(ranges: list[tuple[int, int]]) -> str:
    return "[" + "".join(_esc(lo, "]-^") if lo == hi else f"{_esc(lo, ']-^')}-{_esc(hi, ']-^')}"
                         for lo, hi in ranges) + "]"  # fmt: skip
