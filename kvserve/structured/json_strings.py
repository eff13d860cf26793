"""A JSON schema's grammar with its length-bounded strings able to hold every JSON character.

xgrammar 0.2.8 writes a string with minLength / maxLength as `"` c{m,n} `"` where c is any
character but a quote, a backslash, CR or LF: no escape sequence could be written inside one,
so a valid answer such as {"s": "a\\nb"} or {"s": "say \\"hi\\""} was unreachable, while raw
control characters, which JSON refuses, were let through. Each such character rule is rewritten
as one JSON character: an unescaped one (no quote, backslash or control character) or one
escape sequence, so the bound still counts characters (an escape as one). No string character
is a surrogate (U+D800-U+DFFF), which xgrammar took as any other. A string `pattern` (a
value's, a propertyNames one, or a patternProperties key: a key under a pattern could hold no
escape either) is swapped for a placeholder before xgrammar converts the schema, and the
placeholder's rule for json_patterns.py's grammar of the pattern after.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from kvserve.structured.exact_formats import exact_formats
from kvserve.structured.false_schemas import without_false
from kvserve.structured.hostname import PATTERN as HOSTNAME
from kvserve.structured.hostname import hostname_grammar
from kvserve.structured.integer_bounds import whole_integers
from kvserve.structured.json_patterns import pattern_grammar
from kvserve.structured.listed_spacing import swap_listed, with_listed
from kvserve.structured.number_forms import swap_numbers, with_numbers
from kvserve.structured.one_of import as_any_of
from kvserve.structured.open_objects import open_where_needed
from kvserve.structured.pattern_required import require_pattern_names
from kvserve.structured.property_names import without_closed_names
from kvserve.structured.schema_walk import rebuilt_children
from kvserve.structured.separators import either_spacing
from kvserve.structured.type_lists import split_type_lists

logger = logging.getLogger(__name__)
# The body xgrammar gives a length-bounded string's character rule.
_BOUNDED_CHAR = re.compile(r'^(\w+) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.MULTILINE)
_ESCAPE_RULE = "kvserve_json_escape"
_ANY_CHAR = r"[^\0-\x1f\"\\\r\n]"  # xgrammar's unbounded string character
_UNICODE_CHAR = r"[^\0-\x1f\"\\\ud800-\udfff]"  # an unescaped JSON character
_PATTERN_RULE = "kvserve_pattern"


def json_schema_grammar(schema: str):
    """The xgrammar Grammar of a JSON schema (no free whitespace: separators compact or spaced,
    separators.py), strings fixed as above,
    string patterns as json_patterns.py writes them (as xgrammar writes them should that fail),
    prepared as `prepared_schema` says, listed objects and arrays spaced as listed_spacing.py
    says and integers and bounded numbers as number_forms.py says."""
    import xgrammar as xgr

    schema = json.dumps(prepared_schema(json.loads(schema)))
    listed: list = []
    numbers: list[dict] = []
    patterns: list[str] = []
    swapped = _swap_patterns(swap_numbers(swap_listed(json.loads(schema), listed), numbers), patterns)
    try:
        text = _with_patterns(_bounded(_ebnf(json.dumps(swapped))), patterns)
        return xgr.Grammar.from_ebnf(with_numbers(with_listed(text, listed), numbers))
    except (RuntimeError, ValueError, IndexError) as e:
        logger.warning("a schema's patterns, listed values and numbers kept as xgrammar writes them: %s", e)
    return xgr.Grammar.from_ebnf(_bounded(_ebnf(schema)))


def _ebnf(schema: str) -> str:
    """xgrammar's grammar text of the schema, its separators compact or spaced (separators.py)."""
    import xgrammar as xgr

    return either_spacing(str(xgr.Grammar.from_json_schema(schema, any_whitespace=False)))


def prepared_schema(schema: Any) -> Any:
    """The schema as xgrammar is given it: `false` properties and branches left out
    (false_schemas.py), propertyNames beside a closing false too (property_names.py), a list of
    types as an anyOf of one type each (type_lists.py), required names made properties
    (pattern_required.py), objects / arrays opened where their minimum needs it (open_objects.py),
    the formats xgrammar writes loosely as exact patterns (exact_formats.py) and integers' bounds
    whole, a bounded multipleOf as its multiples (integer_bounds.py), a oneOf (proved exclusive)
    as anyOf (one_of.py)."""
    typed = split_type_lists(without_closed_names(without_false(schema)))
    return as_any_of(whole_integers(exact_formats(open_where_needed(require_pattern_names(typed)))))


def _bounded(text: str) -> str:
    """Length-bounded strings' character rules as one JSON character each; no string character
    a surrogate (its 3-byte form is no UTF-8: decoded, one character became three U+FFFD)."""
    text = text.replace(_ANY_CHAR, _UNICODE_CHAR)
    if not _BOUNDED_CHAR.search(text):
        return text
    escape = _unused(_ESCAPE_RULE, text)
    text = _BOUNDED_CHAR.sub(lambda m: f'{m.group(1)} ::= {_UNICODE_CHAR} | "\\\\" {escape}', text)
    return text + f'\n{escape} ::= [\\"\\\\/bfnrt] | "u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9]\n'


def _with_patterns(text: str, patterns: list[str]) -> str:
    """Each placeholder's rule pointing at its pattern's grammar (ValueError: not found)."""
    for i, pattern in enumerate(patterns):
        rule = re.compile(rf'^(\w+) ::= Regex\("{_placeholder(i)}", json_string=true\)$', re.MULTILINE)
        if len(rule.findall(text)) != text.count(_placeholder(i)):
            raise ValueError(f"pattern {i} is not where it was expected")
        prefix = _unused(f"{_PATTERN_RULE}{i}", text)
        # format: hostname's pattern (exact_formats.py) is written with the name's length bounded too
        grammar = hostname_grammar(prefix) if pattern == HOSTNAME else pattern_grammar(pattern, prefix)
        text = rule.sub(rf"\1 ::= {prefix}", text) + "\n" + grammar + "\n"
    return text


def _unused(name: str, text: str) -> str:
    """`name`, lengthened until no rule of `text` starts with it."""
    while re.search(rf"^{name}", text, re.MULTILINE):
        name += "_"
    return name


def _placeholder(i: int) -> str:
    return f"kvservepattern{i}z"  # letters and digits: xgrammar writes it as Regex("...")


def _swap_patterns(node, patterns: list[str]):
    """The schema with each string `pattern` and each patternProperties key (a key's pattern:
    xgrammar writes it as a value's) replaced by a placeholder (appended to patterns); values
    that are data, not schemas (const, enum, default, examples), and the names in a map of
    schemas (a property named "const" or "patternProperties") left as they are."""
    out = rebuilt_children(node, lambda v: _swap_patterns(v, patterns))
    if not isinstance(out, dict):
        return out
    if isinstance(out.get("pattern"), str):
        patterns.append(out["pattern"])
        out["pattern"] = _placeholder(len(patterns) - 1)
    if isinstance(out.get("patternProperties"), dict):  # its keys are patterns too
        named = {}
        for name, schema in out["patternProperties"].items():
            patterns.append(name)
            named[_placeholder(len(patterns) - 1)] = schema
        out["patternProperties"] = named
    return out
