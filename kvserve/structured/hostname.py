"""`format: hostname` as a grammar that bounds each label at 63 characters and the name at 253.

RFC 1123 bounds both, and a grammar counting both exactly needs a state per (characters so far,
characters of this label so far), some 15,000: compiled against a real vocabulary that took
minutes. Here the name's length is counted in units of 8 characters instead, a label and the dot
after it charged by its length class: up to 7 characters 1 unit, up to 15 2, up to 31 4, up to 63
8, the whole name at most 31 units (248 characters, so at most 247 with the dots between). Every
name written is a valid host name; a valid one is refused only past 31 short labels, or where long
labels add up past the units (three of 63 characters leave room for one of 31 and one of 7). Its
rules: one a label class, one a units-left count (about 100 alternatives; the default model's
vocabulary compiles them in about 0.2 s of CPU).
"""

from __future__ import annotations

from kvserve.structured.json_patterns import pattern_grammar

_ALNUM = "[A-Za-z0-9]"
# RFC 1123 host names: labels of 1-63 letters, digits and hyphens, no hyphen at either end.
LABEL = f"{_ALNUM}([A-Za-z0-9-]{{0,61}}{_ALNUM})?"
PATTERN = f"^{LABEL}(\\.{LABEL})*$"
"""The format as a pattern: what the 400 check reads; the compile writes hostname_grammar for it
(for a schema's own pattern spelled exactly so too: the same names, the length bounded)."""

UNIT = 8
UNITS = 31  # 31 * 8 = 248: the labels and a dot after each, the last one's not written
# (units, shortest, longest): a label's length class, disjoint (a class each: fewer parse states).
CLASSES = ((1, 1, 7), (2, 8, 15), (4, 16, 31), (8, 32, 63))


def hostname_grammar(prefix: str) -> str:
    """EBNF rules (the first named `prefix`) of a JSON string's text, without its quotes, that
    is a host name: labels of at most 63 characters, the name well within 253 (above)."""
    rules = [f"{prefix} ::= {prefix}_h{UNITS}"]
    for units, shortest, longest in CLASSES:
        rules.append(pattern_grammar(_label(shortest, longest), f"{prefix}_l{units}"))
    rules.append(pattern_grammar(r"^\.$", f"{prefix}_dot"))
    for left in range(1, UNITS + 1):
        alternatives = [
            f"{prefix}_l{units}" + ("" if units == left else f" ({prefix}_dot {prefix}_h{left - units})?")
            for units, _, _ in CLASSES
            if units <= left
        ]
        rules.append(f"{prefix}_h{left} ::= " + " | ".join(f"({a})" for a in alternatives))
    return "\n".join(rules)


def _label(shortest: int, longest: int) -> str:
    """A label of `shortest` to `longest` characters, as a pattern."""
    if shortest == 1:
        return f"^{_ALNUM}([A-Za-z0-9-]{{0,{longest - 2}}}{_ALNUM})?$"
    return f"^{_ALNUM}[A-Za-z0-9-]{{{shortest - 2},{longest - 2}}}{_ALNUM}$"
