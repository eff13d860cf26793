"""A JSON schema's grammar with its length-bounded strings able to hold every JSON character.

xgrammar 0.2.8 writes a string with minLength / maxLength as `"` c{m,n} `"` where c is any
character but a quote, a backslash, CR or LF: no escape sequence could be written inside one,
so a valid answer such as {"s": "a\\nb"} or {"s": "say \\"hi\\""} was unreachable, while raw
control characters, which JSON refuses, were let through. Each such character rule is rewritten
as one JSON character: an unescaped one (no quote, backslash or control character) or one
escape sequence, so the bound still counts characters (an escape as one).
"""

from __future__ import annotations

import re

# The body xgrammar gives a length-bounded string's character rule.
_BOUNDED_CHAR = re.compile(r'^(\w+) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.MULTILINE)
_ESCAPE_RULE = "kvserve_json_escape"


def json_schema_grammar(schema: str):
    """The xgrammar Grammar of a JSON schema (no free whitespace), strings fixed as above."""
    import xgrammar as xgr

    text = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
    if not _BOUNDED_CHAR.search(text):
        return xgr.Grammar.from_ebnf(text)
    escape = _ESCAPE_RULE
    while re.search(rf"^{escape} ::=", text, re.MULTILINE):  # a name the schema's rules do not use
        escape += "_"
    text = _BOUNDED_CHAR.sub(rf'\1 ::= [^\\0-\\x1f"\\\\] | "\\\\" {escape}', text)
    text += f'\n{escape} ::= [\\"\\\\/bfnrt] | "u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9]\n'
    return xgr.Grammar.from_ebnf(text)
