"""What a request asks to be constrained to, as a cache key and as an xgrammar Grammar.

`check()` parses without a tokenizer, so the caller's side (API process, offline LLM) can
refuse an invalid schema, regex or grammar with a ValueError that names the problem before
anything reaches the engine core.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections.abc import Iterator

from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured.counts import counted
from kvserve.structured.json_strings import prepared_schema
from kvserve.structured.listed_spacing import swap_listed
from kvserve.structured.number_forms import swap_numbers
from kvserve.structured.productive import unproductive_root
from kvserve.structured.regex_flavour import for_xgrammar
from kvserve.structured.schema_support import unsatisfiable, unsupported
from kvserve.structured.schema_walk import DATA, NAMED

# xgrammar's errors start with "[hh:mm:ss] /path/file.cc:123: "; the rest is the message.
_LOCATION = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")
# Its failed internal assertions add "Check failed: (error.empty()) is false: ": not the client's.
_ASSERTION = re.compile(r"Check failed: \(.*?\) is false:\s*")
# A regex is parsed as the EBNF xgrammar writes for it: a line and column there point at no text
# the client sent.
_EBNF_PLACE = re.compile(r"^EBNF (?:parser|lexer) error at line \d+, column \d+:\s*")

_SURROGATE = re.compile("[\ud800-\udfff]")  # a str holds a pair as one character: these are lone

GrammarKey = tuple[str, str]
# xgrammar's conversion of a schema grows with about the cube of its nesting (objects 63 deep, 127
# here: 0.05 s; 200 deep: 2.2 s; arrays 900 deep: about a minute, in the API process and again in
# the engine's compile), far past what a schema written for an answer needs (OpenAI's strict mode
# stops at 10 levels of objects).
MAX_SCHEMA_DEPTH = 128
# A schema's properties, all its objects' together: OpenAI's structured outputs take at most 5,000.
# The compile grows faster than their count (500: 1 s, 2,000: 12 s on a 512-token vocabulary) and
# holds the large-spec lane (backend.py) that long, while a 16 MB body could hold 100,000s.
MAX_SCHEMA_PROPERTIES = 5000
# A schema's enum values, all its enums' together, counted and as JSON text. xgrammar's compile
# grows much faster than either (default model, 49k vocabulary: 10,000 short strings 0.9-1.8 s,
# 30,000 7 s, 100,000 224 s plus 11 s converting in the API process; 10,000 integers 3.9 s; 2,000
# strings of 100 characters, 222k characters, 2.0 s, 5,000, 555k, 5.8 s, 10,000, 1.1M, 171 s), holding the
# large-spec lane all that time; these caps keep it to seconds (OpenAI's structured outputs take
# 1,000 values, and 15,000 characters in an enum of more than 250).
MAX_ENUM_VALUES = 10_000
MAX_ENUM_CHARS = 250_000
# A const is a one-value enum: counted with them (500,000 characters of const took 14 s). Property
# names are written as literals too (one of 500,000 characters: 13 s), and capped at the same size.
MAX_NAME_CHARS = 250_000
# A schema's patterns, pattern and patternProperties keys, as text: each is written with its
# characters spelt every way JSON can. Their compile grew with the square of a pattern's length
# (1,000 characters of literal 0.3 s, 2,000 1.1 s, 5,000 13 s, 10,000 52 s) until json_patterns.py
# wrote each spelling once and long sequences in pieces (10,000 random characters: 36 s, now 0.1 s
# on a 25k-token vocabulary); it grows with their total, which these caps still bound. A regex
# constraint, plain text, is not respelt nor capped. Patterns written for answers are short (an
# email address's: 150 characters).
MAX_PATTERN_CHARS = 2_000
MAX_PATTERNS_CHARS = 10_000


def grammar_key(so: StructuredOutputsParams) -> GrammarKey:
    """(kind, text): the compile-cache key; equal specs share one compiled grammar."""
    if so.json is not None:
        return ("json", so.json)
    if so.json_object:
        return ("json_object", "")
    if so.regex is not None:
        return ("regex", so.regex)
    if so.choice is not None:
        return ("grammar", choice_ebnf(so.choice))
    assert so.grammar is not None
    return ("grammar", so.grammar)


def choice_ebnf(choices: list[str]) -> str:
    """One alternative per choice; JSON string escapes are valid EBNF string literals."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def check(so: StructuredOutputsParams) -> None:
    """Parse the grammar; raises ValueError("structured_outputs: invalid <kind>: <why>")."""
    _check_key(*grammar_key(so), "choice" if so.choice is not None else None)


@functools.lru_cache(maxsize=256)
def _check_key(kind: str, text: str, label: str | None) -> None:
    import xgrammar as xgr

    label = label or {"json": "json schema", "regex": "regex", "grammar": "grammar"}.get(kind, kind)
    try:
        schema = parse_schema(text) if kind == "json" else None
        lone = _lone_surrogate(text if schema is None else schema)
        if lone is not None:  # xgrammar's words were a UTF-8 codec's, or the whole schema echoed back
            raise ValueError(f"it holds a lone surrogate (U+{ord(lone):04X}), which no text can hold")
        if kind == "json":
            empty = unsatisfiable(schema)
            if empty is not None:
                key, where, why = empty
                raise ValueError(f"{key} at {where}: {why}")
            # Numbers and listed values as placeholders, as the compile has them: xgrammar refuses an
            # integer bound past 64 bits (number_ranges.py), and a listed one past a double's range
            # with an empty RuntimeError.
            prepared = json.dumps(swap_numbers(swap_listed(prepared_schema(schema), []), []))
            try:
                _refuse_if_endless(xgr.Grammar.from_json_schema(prepared, any_whitespace=False))
            except RuntimeError:
                _refuse_unsupported(schema)  # a keyword we refuse, said in our words, before xgrammar's
                raise
            _refuse_unsupported(schema)
        elif kind == "regex":
            try:
                grammar = xgr.Grammar.from_regex(for_xgrammar(text, python=True))  # as compiled
            except RuntimeError as e:
                raise ValueError(_EBNF_PLACE.sub("", clean_error(e))) from None
            _refuse_if_empty(grammar)
        elif kind == "grammar":
            grammar = xgr.Grammar.from_ebnf(text)
            _refuse_if_empty(grammar)
            _refuse_if_endless(grammar)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"structured_outputs: invalid {label}: {clean_error(e)}") from None


def _lone_surrogate(value) -> str | None:
    """The first lone surrogate in a string, or in a JSON value's strings and names (iterative)."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            found = _SURROGATE.search(node)
            if found:
                return found.group()
        elif isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return None


def _refuse_unsupported(schema) -> None:
    refused = unsupported(schema)
    if refused is not None:
        key, where, why = refused
        raise ValueError(f"{key} at {where} is not supported: {why}")


def parse_schema(text: str):
    """The schema a string holds; ValueError saying why it is none (xgrammar's own message for
    text that is no JSON is an internal assertion that echoes the whole text back)."""
    try:
        schema = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        where = f"line {e.lineno} column {e.colno}"
        raise ValueError(f"the schema is not valid JSON ({e.msg} at {where})") from None
    except ValueError as e:  # NaN / Infinity, or an integer past Python's digit limit
        why = str(e) if str(e).endswith("is not JSON") else "a number with too many digits"
        raise ValueError(f"the schema is not valid JSON ({why})") from None
    except RecursionError:
        raise ValueError("the schema is not valid JSON (arrays or objects nested too deeply)") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"a schema is a JSON object (or true / false), not {_json_type(schema)}")
    properties = _properties(schema)
    if properties > MAX_SCHEMA_PROPERTIES:
        raise ValueError(
            f"the schema defines {properties:,} properties in all (at most {MAX_SCHEMA_PROPERTIES:,}, as "
            "OpenAI's structured outputs)"
        )
    values, chars = _enum_size(schema)
    if values > MAX_ENUM_VALUES or chars > MAX_ENUM_CHARS:
        raise ValueError(
            f"the schema's enum lists and consts hold {counted(values, 'value')}, {chars:,} characters of "
            f"JSON, in all (at most {MAX_ENUM_VALUES:,} values and {MAX_ENUM_CHARS:,} characters: compiling "
            "more takes minutes); use a pattern, or fewer values"
        )
    names = sum(
        len(name)
        for n in _objects(schema)
        if isinstance(n.get("properties"), dict)
        for name in n["properties"]
    )
    if names > MAX_NAME_CHARS:
        raise ValueError(
            f"the schema's property names hold {names:,} characters in all (at most {MAX_NAME_CHARS:,}: "
            "compiling more takes minutes)"
        )
    patterns = _patterns(schema)
    if max(patterns, default=0) > MAX_PATTERN_CHARS or sum(patterns) > MAX_PATTERNS_CHARS:
        raise ValueError(
            f"the schema's patterns (pattern, patternProperties) hold {sum(patterns):,} characters in all, "
            f"the longest {max(patterns):,} (at most {MAX_PATTERNS_CHARS:,} in all, {MAX_PATTERN_CHARS:,} "
            "each: compiling more takes minutes); a list of words is an enum"
        )
    depth = _depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(
            f"the schema nests {depth} objects and arrays deep (at most {MAX_SCHEMA_DEPTH}); "
            "use $defs and $ref for recursive structures"
        )
    return schema


def _depth(value) -> int:
    """How many objects and arrays deep a JSON value nests (iterative: no recursion limit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in children)
    return deepest


def _objects(value) -> Iterator[dict]:
    """Every object of a schema but data values (iterative: no recursion limit); a map of named
    subschemas is walked name by name, so a property named "default" or "enum" is a schema (the
    counts below skipped it as data, and with it whatever it held)."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            yield node
            for key, child in node.items():
                if key in NAMED and isinstance(child, dict):
                    stack.extend(child.values())
                elif key not in DATA:
                    stack.append(child)


def _properties(value) -> int:
    """How many properties a schema's `properties` maps name in all (data values not counted)."""
    return sum(len(n["properties"]) for n in _objects(value) if isinstance(n.get("properties"), dict))


def _enum_size(value) -> tuple[int, int]:
    """How many values a schema's `enum` lists and consts hold in all, and their JSON text's
    length: data values are not walked, a map of named subschemas is (a property named "enum" is
    a schema)."""
    objects = list(_objects(value))
    enums = [n["enum"] for n in objects if isinstance(n.get("enum"), list)]
    enums += [[n["const"]] for n in objects if "const" in n]
    return sum(map(len, enums)), sum(len(json.dumps(e, ensure_ascii=False)) for e in enums)


def _patterns(value) -> list[int]:
    """The length of each of a schema's patterns (its `pattern`s, patternProperties' keys)."""
    lengths = []
    for node in _objects(value):
        if isinstance(node.get("pattern"), str):
            lengths.append(len(node["pattern"]))
        if isinstance(node.get("patternProperties"), dict):
            lengths += map(len, node["patternProperties"])
    return lengths


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _json_type(value) -> str:
    names = {list: "an array", str: "a string", int: "a number", float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


_byte_compiler = None
_byte_lock = threading.Lock()
_STOP = 256  # the byte vocabulary's stop token


def _refuse_if_empty(grammar) -> None:
    """Raise ValueError when the grammar matches no text at all (e.g. `root ::= root`).

    xgrammar parses such a grammar, and its matcher then allows no first token and cannot
    end: every token the model samples is refused, so the request would answer empty text and
    log a warning. Compiled against a vocabulary of the 256 single bytes plus a stop token (a
    few milliseconds, independent of the model), a grammar that matches some text allows its
    first byte, or the stop token when it matches the empty text; one that matches none allows
    nothing. JSON schemas are not checked here: xgrammar refuses the empty ones itself
    (`false`, an empty enum, minimum above maximum), and a large schema compiles slowly.
    """
    import xgrammar as xgr

    global _byte_compiler
    with _byte_lock:  # the API process's threads share one compiler
        if _byte_compiler is None:
            vocab = [bytes([b]) for b in range(256)] + [b"</s>"]
            info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, stop_token_ids=[_STOP])
            _byte_compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        compiled = _byte_compiler.compile_grammar(grammar)
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, _STOP + 1)
    matcher.fill_next_token_bitmask(bitmask)
    if not bool(bitmask.any()):
        raise ValueError("it matches no text (no first character is allowed and it cannot end)")


def _refuse_if_endless(grammar) -> None:
    """Raise ValueError when every derivation recurses forever (e.g. `root ::= "a" root`).

    Such a grammar allows a first byte, so `_refuse_if_empty` passes it, but no text ever
    completes it: the request could only stop at max_tokens, with output the schema or grammar
    never accepts. A required self-reference in a JSON schema is the same case.
    """
    if unproductive_root(grammar):
        raise ValueError("it matches no finite text (every derivation of root recurses forever)")


def clean_error(e: Exception) -> str:
    lines = [_ASSERTION.sub("", _LOCATION.sub("", ln)).strip() for ln in str(e).splitlines()]
    return " ".join(ln for ln in lines if ln) or type(e).__name__
