"""`.` as each regex flavour defines it: xgrammar 0.2.8 lets it match every character.

A JSON schema's `pattern` (and a patternProperties or propertyNames key) is an ECMA-262 regex,
whose `.` matches no line terminator (LF, CR, U+2028, U+2029); a `regex` constraint has
Python's `re` semantics (vLLM's), whose `.` matches anything but LF. xgrammar writes `.` as
every code point, so `^a.b$` let `{"s": "a\\nb"}` through, which the schema refuses. Each `.`
outside a class is written as the class it stands for before xgrammar reads the regex.
"""

from __future__ import annotations

ECMA_DOT = r"[^\n\r\u2028\u2029]"
PYTHON_DOT = r"[^\n]"


def explicit_dots(pattern: str, dot: str) -> str:
    """`pattern` with every `.` that is no literal (escaped, or inside a class) replaced by
    `dot`. A class ends at its first unescaped `]`, as xgrammar reads it (`[]` is empty)."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            out.append(pattern[i : i + 2])
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        elif c == ".":
            c = dot
        out.append(c)
        i += 1
    return "".join(out)
