"""Regex grammars respelt: a JSON schema's string `pattern` (or a key's) over the string's JSON
text, and a regex constraint's classes without surrogates.

xgrammar 0.2.8 writes a pattern either as a regex whose classes leave out a quote, a backslash
and control characters (a value holding one, e.g. 'say "hi"' for `^.+$`, was unreachable) or,
for some patterns, as the regex's raw characters (`.` let a bare quote or newline into the
output, and `a"b` was written unescaped: text json.loads refuses). Here the pattern's own
grammar (xgrammar's regex conversion, over characters) has each terminal rewritten to the
characters' JSON spelling: a quote, a backslash or a control character escaped, any other
character as itself. No class keeps a surrogate (U+D800-U+DFFF): their 3-byte forms are no
UTF-8, and decoded each byte became a U+FFFD the pattern never allowed. Every character may
also be written as JSON lets any string character be: a `\\uXXXX` escape (hex digits in either
case; a surrogate pair for one past U+FFFF), and `\\/` for a solidus, as the schema's other
strings may (`"\\u0061"`, the string "a", was refused for `^a+$`).
"""

from __future__ import annotations

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
# JSON's two-character escapes: a quote, a backslash and five controls must be escaped; a
# solidus may be.
_SHORT = {0x22: '\\"', 0x5C: "\\\\", 0x08: "\\b", 0x0C: "\\f", 0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t",
          0x2F: "\\/"}  # fmt: skip


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
    for a regex constraint: regex_flavour.py), each rule's terminals respelt (_terminals). In
    JSON text each character's spellings are one rule, named once and referred to wherever the
    character stands: written inline, a pattern of n characters was n alternation groups in
    one sequence, which xgrammar compiles in time growing with n squared (2,000 characters:
    seconds on a real vocabulary)."""
    import xgrammar as xgr

    text = str(xgr.Grammar.from_regex(for_xgrammar(pattern, python=not json_text)))
    lines = [line for line in text.splitlines() if line.strip()]
    if not json_text:
        return "\n".join(_terminals(line, None) for line in lines)
    numbers = [int(n) for n in re.findall(r"\broot_(\d+)", text)]
    named = _NamedRules(f"root_{max(numbers, default=0) + 1}_")
    rules = [_short_sequences(_terminals(line, named), named) for line in lines]
    return "\n".join(rules + named.rules())


class _NamedRules:
    """One rule a distinct body (a class of JSON spellings, a piece of a long sequence), named
    `prefix` and a number."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.names: dict[str, str] = {}

    def __call__(self, ranges: list[tuple[int, int]]) -> str:
        return self.name(_class(ranges))

    def name(self, body: str) -> str:
        return self.names.setdefault(body, f"{self.prefix}{len(self.names)}")

    def rules(self) -> list[str]:
        return [f"{name} ::= {body}" for body, name in self.names.items()]


# A sequence of rule references, each perhaps repeated: in a rule below the root, xgrammar's
# compile grows with the square of such a sequence's length (2,000 references: 1 s on a
# 257-token vocabulary), of a sequence of sequences of _PIECE each, linearly.
_PIECE = 16
_ELEMENT = r"[A-Za-z_]\w*(?:\{[\d, -]*\}|[*+?])?"
_LONG_RUN = re.compile(rf"(?<![\w\"\]]){_ELEMENT}(?: {_ELEMENT}){{{_PIECE},}}(?![\w{{*+?])")


def _short_sequences(line: str, named: _NamedRules) -> str:
    """The rule with each sequence of more than _PIECE references cut into named pieces of
    _PIECE (pieces of pieces, while longer)."""

    def pieces(run: re.Match) -> str:
        refs = re.findall(_ELEMENT, run.group())
        return " ".join(named.name(" ".join(refs[i : i + _PIECE])) for i in range(0, len(refs), _PIECE))

    head, body = line.split(" ::= ", 1)
    while (shorter := _LONG_RUN.sub(pieces, body)) != body:
        body = shorter
    return f"{head} ::= {body}"


def _terminals(line: str, named: _NamedRules | None) -> str:
    """One rule with every character class (and, for JSON text, string literal) respelt: as
    plain text when `named` is None, else as JSON text (`named` names each class's rule)."""
    out, i = [], line.index("::=") + 3
    out.append(line[:i])
    while i < len(line):
        c = line[i]
        if c == '"':
            start = i
            chars, i = _read(line, i + 1, '"')
            out.append(_literal_chars("".join(chars), named) if named else line[start:i])
        elif c == "[":
            negated = line.startswith("^", i + 1)
            chars, i = _read(line, i + 2 if negated else i + 1, "]", ranges=True)
            ranges = complement(chars) if negated else chars
            out.append(named(ranges) if named else _plain_class(ranges))
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
    """A class of code points as JSON text: the plain ones as a class, the others by their
    short escape, and every one (no surrogate) as a `\\u` escape too."""
    kept = complement([_SURROGATES] + complement(ranges))
    plain = complement([(cp, cp) for cp in _SPECIAL] + complement(kept))
    alts = [_ranges(plain)] if plain else []
    alts += [_literal(short) for cp, short in _SHORT.items() if any(lo <= cp <= hi for lo, hi in kept)]
    alts += unicode_escapes(kept)
    return "(" + " | ".join(alts) + ")"


def _literal(text: str) -> str:
    return '"' + "".join(_esc(ord(ch)) for ch in text) + '"'


def _literal_chars(text: str, named: _NamedRules) -> str:
    """A pattern's literal text as JSON text: each character as itself (escaped where JSON
    needs it) or any other spelling JSON has for it."""
    return " ".join(named([(ord(ch), ord(ch))]) for ch in text) if text else '""'


def unicode_escapes(ranges: list[tuple[int, int]]) -> list[str]:
    """EBNF alternatives writing each code point of `ranges` (no surrogates) as a `\\uXXXX`
    escape, or a surrogate pair of them past U+FFFF; hex digits in either case."""
    alts = []
    for lo, hi in ranges:
        if lo <= 0xFFFF:
            alts += ['"\\\\u" ' + _hex_digits(seq) for seq in _hex_range(lo, min(hi, 0xFFFF), 4)]
        for high, low in _surrogate_pairs(max(lo, 0x10000), hi):
            halts = " | ".join(_hex_digits(seq) for seq in _hex_range(*high, 4))
            lalts = " | ".join(_hex_digits(seq) for seq in _hex_range(*low, 4))
            alts.append(f'"\\\\u" ({halts}) "\\\\u" ({lalts})')
    return alts


def _hex_range(lo: int, hi: int, digits: int) -> list[list[tuple[int, int]]]:
    """[lo, hi] as sequences of hex digit ranges, `digits` long (at most 2 * digits - 1)."""
    if lo > hi:
        return []
    if digits == 1:
        return [[(lo, hi)]]
    size = 16 ** (digits - 1)
    top_lo, top_hi, rest_lo, rest_hi = lo // size, hi // size, lo % size, hi % size
    if top_lo == top_hi:
        return [[(top_lo, top_lo), *seq] for seq in _hex_range(rest_lo, rest_hi, digits - 1)]
    out = []
    if rest_lo:
        out += [[(top_lo, top_lo), *seq] for seq in _hex_range(rest_lo, size - 1, digits - 1)]
        top_lo += 1
    tail = []
    if rest_hi != size - 1:
        tail = [[(top_hi, top_hi), *seq] for seq in _hex_range(0, rest_hi, digits - 1)]
        top_hi -= 1
    if top_lo <= top_hi:
        out.append([(top_lo, top_hi)] + [(0, 15)] * (digits - 1))
    return out + tail


def _hex_digits(seq: list[tuple[int, int]]) -> str:
    """Hex digit ranges as EBNF: one class per digit, a letter in either case."""
    parts = []
    for lo, hi in seq:
        digits = f"{lo}-{min(hi, 9)}" if lo < 10 else ""
        letters = (chr(87 + max(lo, 10)), chr(87 + hi)) if hi >= 10 else None
        if letters is not None:
            digits += f"{letters[0]}-{letters[1]}{letters[0].upper()}-{letters[1].upper()}"
        parts.append(f"[{digits}]")
    return " ".join(parts)


def _surrogate_pairs(lo: int, hi: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Code points [lo, hi] past U+FFFF as (high surrogates, low surrogates) range pairs."""
    if lo > hi:
        return []
    (h_lo, l_lo), (h_hi, l_hi) = _split(lo), _split(hi)
    if h_lo == h_hi:
        return [((h_lo, h_lo), (l_lo, l_hi))]
    pairs = [((h_lo, h_lo), (l_lo, 0xDFFF))]
    if h_lo + 1 <= h_hi - 1:
        pairs.append(((h_lo + 1, h_hi - 1), (0xDC00, 0xDFFF)))
    return pairs + [((h_hi, h_hi), (0xDC00, l_hi))]


def _split(cp: int) -> tuple[int, int]:
    return 0xD800 + ((cp - 0x10000) >> 10), 0xDC00 + ((cp - 0x10000) & 0x3FF)


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
