"""A JSON answer's separators compact or spaced: `[1,2]` and `{"a":1}` as well as `[1, 2]`.

Free whitespace stays off (xgrammar's `any_whitespace`, on by default in vLLM): small models
given `[ \\n\\t]*` between tokens wrote whitespace until max_tokens. But xgrammar without it
writes every separator as `", "` and `": "`, so a model that writes compact JSON, as many do
for tool arguments, was pushed off its own text token by token. Each separator is either
spelling here, one optional space: no run of whitespace can grow.
"""

from __future__ import annotations

import re

# A separator token of xgrammar's grammar text: the whole literal, not a quote inside one (a
# literal's own quote is escaped `\"`).
_SEPARATOR = re.compile(r'(?<![\\"])"([,:]) "')


def either_spacing(ebnf: str) -> str:
    """The grammar text with each `", "` / `": "` literal as `("," | ", ")` / `(":" | ": ")`."""
    return _SEPARATOR.sub(lambda m: f'("{m.group(1)}" | "{m.group(1)} ")', ebnf)
