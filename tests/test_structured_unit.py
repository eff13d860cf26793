"""Structured outputs and tool calling without a model: grammar checks, request translation,
the tool-call parser and its streamed deltas."""

from __future__ import annotations

import json
import random
import re
import time

import jsonschema
import pytest

from kvserve.entrypoints.openai.compat import normalize_chat
from kvserve.entrypoints.openai.protocol import ChatCompletionRequest
from kvserve.entrypoints.openai.tool_parser import ParsedCall, ToolCallStream, json_value_end, parse_calls
from kvserve.entrypoints.openai.tools import call_constraint, conversation, tool_mode
from kvserve.sampling_params import StructuredOutputsParams as S
from kvserve.structured.spec import check, grammar_key, parse_schema

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time"}},
]  # fmt: skip


@pytest.mark.parametrize(
    "so, words",
    [
        (S(json={"type": "foo"}), ["invalid json schema", "foo"]),
        (S(regex="(["), ["invalid regex", "Unclosed"]),
        (S(grammar="root ::= foo"), ["invalid grammar", "foo"]),
    ],
)
def test_invalid_grammars_name_the_problem(so, words):
    with pytest.raises(ValueError) as e:
        check(so)
    assert str(e.value).startswith("structured_outputs: ") and all(w in str(e.value) for w in words)


@pytest.mark.parametrize(
    "so, says",
    [
        (S(json="{not json"), "(Expecting property name enclosed in double quotes at line 1 column 2)"),
        (S(json=""), "the schema is not valid JSON (Expecting value at line 1 column 1)"),
        (S(json='{"type": "number", "minimum": NaN}'), "the schema is not valid JSON (NaN is not JSON)"),
        (S(json={"type": "number", "maximum": float("inf")}), "not valid JSON (Infinity is not JSON)"),
        (S(json="1" * 5000), "the schema is not valid JSON (a number with too many digits)"),
        (S(json="[1, 2]"), "a schema is a JSON object (or true / false), not an array"),
        (S(json='"object"'), "a schema is a JSON object (or true / false), not a string"),
        (S(regex="[z-a]"), "invalid regex: Invalid character class: lower bound is larger than upper bound"),
        (S(regex="a{5,2}"), "invalid regex: Lower bound is larger than upper bound: 5 > 2"),
    ],
)  # fmt: skip
def test_a_constraint_given_as_text_says_what_is_wrong_in_the_clients_terms(so, says):
    """A schema string that is no JSON came back as xgrammar's failed internal assertion
    ("Check failed: (error.empty()) is false: ... The JSON string is: <the whole schema>"), and
    a regex's error pointed at a line and column of the EBNF xgrammar writes for it."""
    with pytest.raises(ValueError) as e:
        check(so)
    message = str(e.value)
    assert message.startswith("structured_outputs: ") and message.endswith(says), message
    assert "Check failed" not in message and "JSON string is" not in message and "EBNF" not in message


def test_a_schema_nested_past_the_limit_is_refused_before_conversion():
    """A schema 400 objects deep took xgrammar 18 s to convert in the API process (and as long
    again in the engine's compile); a few hundred kB of nesting, minutes."""

    def nested(levels: int) -> str:
        return '{"type": "object", "properties": {"a": ' * levels + '{"type": "string"}' + "}}" * levels

    check(S(json=nested(63)))  # 127 objects deep: the limit is 128
    with pytest.raises(ValueError) as e:
        check(S(json=nested(64)))
    assert str(e.value) == (
        "structured_outputs: invalid json schema: the schema nests 129 objects and arrays deep (at most "
        "128); use $defs and $ref for recursive structures"
    )
    with pytest.raises(ValueError, match=r"not valid JSON \(arrays or objects nested too deeply\)"):
        check(S(json="[" * 100_000 + "]" * 100_000))  # past the parser's recursion limit


def _refusal(schema: dict) -> str:
    """check()'s refusal of `schema`, which comes before any conversion or compile: the walk
    takes milliseconds, a compile of what it refuses seconds to minutes (a wide margin)."""
    start = time.monotonic()
    with pytest.raises(ValueError) as e:
        check(S(json=schema))
    assert time.monotonic() - start < 30
    return str(e.value)


def test_a_schema_past_5000_properties_is_refused_before_conversion():
    """A 16 MB body could hold a schema of 100,000s of properties, and its compile grows faster
    than their count (2,000: 12 s on a 512-token vocabulary), holding the compile lane all that
    time: past OpenAI's 5,000 properties in all it is refused at once."""
    halves = [
        {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}
        for n in (2501, 2500)
    ]
    schema = {
        "type": "object",
        "properties": {"a": halves[0], "b": halves[1]},
        "enum": [{"properties": {"x": 1}}],
    }
    assert _refusal(schema) == (
        "structured_outputs: invalid json schema: the schema defines 5,003 properties in all "
        "(at most 5,000, as OpenAI's structured outputs)"
    )


@pytest.mark.parametrize("name", ["default", "enum", "const", "examples"])
def test_a_property_named_as_data_is_counted_as_a_schema(name):
    """The property count skipped a property named "default" (or enum, const, examples) as a
    data value, and all it held: 6,000 properties under it passed the 5,000 cap."""
    inner = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(6000)}}
    with pytest.raises(ValueError, match="the schema defines 6,001 properties in all"):
        check(S(json={"type": "object", "properties": {name: inner}}))


def test_a_schema_past_10000_enum_values_is_refused_before_conversion():
    """xgrammar's compile of an enum grows much faster than its values (on the default model's
    vocabulary 10,000 strings take 1.8 s, 100,000 224 s, plus 11 s converting here), holding the
    compile lane: past 10,000 values in all it is refused at once, naming enum. A property named
    "enum" is a schema, walked too; an enum inside a default value is data, not counted."""
    schema = {
        "type": "object",
        "properties": {
            "a": {"enum": [f"v{i}" for i in range(6000)]},
            "enum": {"type": "array", "items": {"enum": list(range(4001))}},
        },
        "default": {"enum": list(range(50_000))},
    }
    assert _refusal(schema) == (
        "structured_outputs: invalid json schema: the schema's enum lists and consts hold 10,001 values, "
        "75,786 characters of JSON, in all (at most 10,000 values and 250,000 characters: compiling "
        "more takes minutes); use a pattern, or fewer values"
    )
    schema["properties"]["enum"]["items"]["enum"].pop()
    assert parse_schema(json.dumps(schema)) == schema  # 10,000: not refused for its enums
    # 2,000 strings of 150 characters: few values, but 308k characters (10,000 of 111: 171 s).
    long = {"enum": [f"{i:04d}" + "x" * 146 for i in range(2000)]}
    with pytest.raises(
        ValueError, match=r"enum lists and consts hold 2,000 values, 308,000 characters of JSON"
    ):
        check(S(json=long))


@pytest.mark.parametrize(
    "schema, says",
    [
        # 500,000 characters of const took 14 s to compile (a const is a one-value enum)
        ({"type": "object", "properties": {"a": {"const": "x" * 500_000}}},
         "enum lists and consts hold 1 value, 500,004 characters of JSON"),
        ({"anyOf": [{"const": "x" * 130_000}, {"enum": ["y" * 130_000]}]},
         "enum lists and consts hold 2 values, 260,008 characters of JSON"),
        # a property name of 500,000 characters: 13 s
        ({"type": "object", "properties": {"k" * 500_000: {"type": "integer"}}},
         "the schema's property names hold 500,000 characters in all (at most 250,000"),
        # a pattern of 10,000 characters: 52 s (5,000: 13 s)
        ({"type": "string", "pattern": "^" + "ab" * 5000 + "$"},
         "the schema's patterns (pattern, patternProperties) hold 10,002 characters in all, the longest "
         "10,002 (at most 10,000 in all, 2,000 each"),
        ({"patternProperties": {f"^{i}" + "k" * 1990 + "$": {"pattern": "^" + "v" * 1990} for i in range(3)}},
         "hold 11,952 characters in all, the longest 1,993"),
    ],
)  # fmt: skip
def test_a_huge_const_name_or_pattern_is_refused_before_conversion(schema, says):
    """Enums were capped, but a const, a property name or a pattern of any size passed the 400
    check and then held the compile lane for seconds to minutes; each is capped in all, the
    const with the enum values, and refused at once naming what is too large."""
    assert says in _refusal(schema)
    many = {f"p{i}": {"type": "string", "pattern": "^[a-z]{3,8}-[0-9]{2,4}$"} for i in range(400)}
    check(S(json={"type": "object", "properties": many}))  # 400 short patterns, 9,200 characters


def test_a_choice_past_10000_strings_or_250000_characters_is_refused():
    """20,000 choices took 24 s to compile (10,000 7.5 s) in the large-spec lane; a list past
    the caps is refused at once, as an enum past them is."""
    check(S(choice=[f"answer {i}" for i in range(10_000)]))
    with pytest.raises(ValueError) as e:
        S(choice=[f"answer {i}" for i in range(10_001)])
    assert str(e.value) == (
        "structured_outputs: choice holds 10,001 strings, 108,902 characters in all (at most 10,000 "
        "strings and 250,000 characters: compiling more takes minutes); use a regex, or fewer choices"
    )
    with pytest.raises(ValueError, match=r"choice holds 1,001 strings, 251,251 characters"):
        S(choice=["x" * 251] * 1001)
    with pytest.raises(ValueError, match=r"choice holds 1 string, 250,001 characters in all"):
        S(choice=["x" * 250_001])


@pytest.mark.parametrize(
    "schema, says",
    [
        ({"type": "object", "required": ["a"], "minProperties": 3},
         "minProperties is 3 and 1 name is required: names the schema does not list may make up the count, "
         'and they are not kept distinct ({"b": 1, "b": 2} counts two; JSON reads one); require at least 2 '
         "names, or lower minProperties to 2"),
        ({"type": "object", "minProperties": 2},
         "0 names are required: names the schema does not list may make up the count, and they are not kept "
         'distinct ({"b": 1, "b": 2} counts two; JSON reads one); require at least 1 name, or lower'),
        ({"type": "object", "properties": {"a": {}}, "additionalProperties": False, "minProperties": 2},
         "minProperties is 2, but additionalProperties is false and properties defines 1 name: no object"),
    ],
)  # fmt: skip
def test_a_refusal_counts_one_in_the_singular(schema, says):
    """The messages read "hold 1 values", "1 names are required", "require at least 1 names"."""
    with pytest.raises(ValueError) as e:
        check(S(json=schema))
    assert says in str(e.value), str(e.value)


BIG = "1" + "0" * 20  # 10**20, past int64
TYPE_LISTS = [
    ({"type": ["number", "null"], "exclusiveMinimum": 0.5},
     [("0.5000001", True), ("5.5e-1", True), ("null", True), ("0.5", False), ("0.4999999", False)]),
    ({"type": ["number", "null"], "maximum": 1e30},
     [("1e30", True), (BIG, True), ("2e30", False)]),
    ({"type": ["integer", "null"], "exclusiveMinimum": 0.5, "exclusiveMaximum": 3.5},
     [("1", True), ("3", True), ("null", True), ("0", False), ("4", False)]),
    ({"type": ["null", "integer"], "minimum": -1e20},
     [("-0", True), ("-" + BIG, True), ("-1" + BIG, False)]),
    ({"type": ["integer", "null"], "minimum": 0.2, "maximum": 0.8},
     [("null", True), ("0", False), ("1", False)]),
    ({"type": ["string", "null"], "format": "date", "title": "day"},
     [('"2024-04-30"', True), ("null", True), ('"2024-04-31"', False)]),
    ({"$defs": {"n": {"type": ["number", "string"], "maximum": 3, "maxLength": 1}},
      "type": ["object", "null"], "properties": {"n": {"$ref": "#/$defs/n"}}, "required": ["n"],
      "additionalProperties": False},
     [('{"n": 3}', True), ('{"n": "x"}', True), ("null", True), ('{"n": 3.5}', False),
      ('{"n": "xy"}', False)]),
    ({"type": ["integer", "null"], "multipleOf": 2},
     [("null", True), ("4", True), ("-2", True), ("0", True), ("3", False), ('"4"', False)]),
    ({"type": ["null", "integer"], "multipleOf": 3, "minimum": 0, "maximum": 30},
     [("null", True), ("9", True), ("30", True), ("4", False), ("-3", False), ("33", False)]),
]  # fmt: skip


@pytest.mark.parametrize("schema, answers", TYPE_LISTS)
def test_a_list_of_types_gets_each_types_exact_grammar(schema, answers):
    """A list of types (a nullable field, as OpenAI's strict mode writes every optional one) passed
    by the rewrites that read one type: xgrammar's own six-decimal bounds refused 0.5000001 under
    exclusiveMinimum 0.5 and 1e30 under maximum 1e30, a bound that is not whole was a 400 ("Integer
    constraint must be a whole number"), -0 and a bound past int64 were refused, 2024-04-31 was a date."""
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from kvserve.structured.json_strings import json_schema_grammar

    check(S(json=schema))
    grammar = json_schema_grammar(json.dumps(schema))
    assert [(t, accepts(grammar, t)) for t, _ in answers] == answers
    numbers = jsonschema.Draft202012Validator(schema)
    assert all(numbers.is_valid(json.loads(t)) == v for t, v in answers if "-04-31" not in t)


@pytest.mark.parametrize(
    "schema, answers",
    [
        ({"type": "object", "properties": {"a": False, "b": {"type": "integer"}}, "required": ["b"]},
         [('{"b": 1}', True), ('{"a": 1, "b": 1}', False), ('{"b": 1, "a": null}', False)]),
        ({"type": "object", "properties": {"a": False}}, [("{}", True), ('{"a": 1}', False)]),
        ({"type": "array", "items": {"anyOf": [False, {"type": "integer"}]}},
         [("[1, 2]", True), ('["x"]', False)]),
        ({"oneOf": [{"type": "string"}, False]}, [('"x"', True), ("1", False)]),
    ],
)  # fmt: skip
def test_a_false_property_is_left_out_of_the_grammar(schema, answers):
    """JSON Schema's false ("no value"): a property that must not be present, a branch that
    matches nothing. xgrammar refused every false subschema ("Schema 'false' cannot accept any
    value"), so these valid schemas were a 400; objects are closed, so leaving them out is exact."""
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from kvserve.structured.json_strings import json_schema_grammar

    check(S(json=schema))
    grammar = json_schema_grammar(json.dumps(schema))
    assert [(t, accepts(grammar, t)) for t, _ in answers] == answers
    valid = jsonschema.Draft202012Validator(schema)
    assert all(valid.is_valid(json.loads(t)) == v for t, v in answers)


@pytest.mark.parametrize(
    "schema, says",
    [({"type": "object",
       "properties": {"x": {"type": "object", "properties": {"a": False}, "required": ["a"]}}},
      "required at /properties/x: the required property 'a' has the schema false: no object meets it"),
     ({"type": "object", "properties": {"a": False}, "additionalProperties": {"type": "integer"}},
      "properties at / is not supported: the property 'a' has the schema false (it must not be present), "
      "which is not enforced where the object writes unlisted names"),
     ({"type": "object", "properties": {"a": False}, "patternProperties": {"^a": {"type": "integer"}}},
      "properties at / is not supported: the property 'a' has the schema false (it must not be present), "
      "which is not enforced where the object writes the pattern '^a'"),
     ({"type": "object", "properties": {"a": False}, "propertyNames": {"pattern": "^[ab]$"}},
      "properties at / is not supported: the property 'a' has the schema false (it must not be present), "
      "which is not enforced where the object writes the names propertyNames allows")],
)  # fmt: skip
def test_a_false_property_required_or_writable_otherwise_is_refused_naming_it(schema, says):
    """Required, no object meets it; beside unlisted names or a pattern that matches it, leaving it
    out of the grammar would let the name back in: both a 400 in our words, not xgrammar's."""
    with pytest.raises(ValueError) as e:
        check(S(json=schema))
    assert str(e.value).startswith(f"structured_outputs: invalid json schema: {says}"), str(e.value)


@pytest.mark.parametrize(
    "schema, answers",
    [({"type": "integer", "multipleOf": 2.5},
      [("5", True), ("-10", True), ("0", True), ("2", False), ("3", False)]),
     ({"type": "integer", "multipleOf": 0.5}, [("3", True), ("-7", True)]),
     ({"type": ["integer", "null"], "multipleOf": 1.5, "minimum": 1, "maximum": 20},
      [("3", True), ("18", True), ("null", True), ("0", False), ("2", False), ("21", False)])],
)  # fmt: skip
def test_an_integers_multiple_of_that_is_not_whole_is_enforced(schema, answers):
    """xgrammar drops a multipleOf that is not whole on an integer: 2 answered `"multipleOf": 2.5`.
    Whole multiples of 5/2 are the multiples of 5 (of 1/2, every integer): written so."""
    _grammar_answers(schema, answers)


def test_a_multiple_of_past_1024_is_listed_between_bounds_and_refused_without():
    """xgrammar drops a multipleOf above 1024, bounds or not: 3 answered `"multipleOf": 2000`, and
    `"minimum": 1, "maximum": 5000` beside a multipleOf of 20,000, which no integer meets."""
    bounded = {"type": "integer", "multipleOf": 2000, "minimum": 0, "maximum": 5000}
    _grammar_answers(bounded, [("0", True), ("4000", True), ("3", False), ("2001", False), ("6000", False)])
    _grammar_answers({"type": "integer", "multipleOf": 1024}, [("2048", True), ("3", False)])
    for schema, says in (
        ({"type": ["integer", "null"], "multipleOf": 2000}, "a multipleOf above 1024 is enforced only"),
        ({"type": "integer", "multipleOf": 20000, "minimum": 1, "maximum": 5000},
         "no multiple of 20000 is within the bounds beside it (from 1 to 5000)"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=re.escape(f"multipleOf at / is not supported: {says}")):
            check(S(json=schema))


def _grammar_answers(schema: dict, answers: list[tuple[str, bool]]) -> None:
    """The schema passes the check, and its grammar and jsonschema both take exactly the answers
    marked True."""
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from kvserve.structured.json_strings import json_schema_grammar

    check(S(json=schema))
    grammar = json_schema_grammar(json.dumps(schema))
    assert [(t, accepts(grammar, t)) for t, _ in answers] == answers
    valid = jsonschema.Draft202012Validator(schema)
    assert all(valid.is_valid(json.loads(t)) == v for t, v in answers)


def test_property_names_are_enforced_beside_a_closing_false_and_on_listed_names():
    """xgrammar wrote propertyNames' names though additionalProperties false forbids them ({"a": 1}
    answered the first schema, whose only value is {}), and did not check listed names against it
    ({"c": 1} answered a schema listing c beside propertyNames ^[ab]$): the first is left without
    the propertyNames it no longer needs, the second refused naming the property."""
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from kvserve.structured.json_strings import json_schema_grammar

    names = {"pattern": "^[ab]$"}
    for schema, answers in (
        ({"type": "object", "propertyNames": names, "additionalProperties": False},
         [("{}", True), ('{"a": 1}', False)]),
        ({"type": "object", "properties": {"b": {"type": "integer"}}, "propertyNames": names,
          "additionalProperties": False}, [("{}", True), ('{"b": 1}', True), ('{"a": 1}', False)]),
    ):  # fmt: skip
        check(S(json=schema))
        grammar = json_schema_grammar(json.dumps(schema))
        assert [(t, accepts(grammar, t)) for t, _ in answers] == answers
        valid = jsonschema.Draft202012Validator(schema)
        assert all(valid.is_valid(json.loads(t)) == v for t, v in answers)
    breaks, unchecked = "the property 'c' breaks propertyNames beside it", "format in propertyNames is not"
    for extra, says in (({}, breaks), ({"additionalProperties": False}, breaks),
                        ({"propertyNames": {"format": "email"}}, unchecked)):  # fmt: skip
        schema = {"type": "object", "properties": {"c": {"type": "integer"}}, "propertyNames": names, **extra}
        with pytest.raises(ValueError, match=f"propertyNames at / is not supported: {says}"):
            check(S(json=schema))


@pytest.mark.parametrize(
    "schema",
    [{"type": ["integer", "number"], "multipleOf": 2}, {"type": ["number", "null"], "multipleOf": 2},
     {"type": ["integer", "null"], "multipleOf": 3, "minimum": 0}],
)  # fmt: skip
def test_a_multiple_of_a_list_of_types_is_refused_where_no_integer_alone_takes_it(schema):
    """A number's multipleOf, or one beside a one-sided bound, is not enforced (xgrammar drops it):
    in a list of types as in one type, it is refused naming the keyword."""
    with pytest.raises(ValueError, match="multipleOf at / is not supported"):
        check(S(json=schema))


@pytest.mark.parametrize(
    "schema, answers",
    [
        ({"type": "number", "exclusiveMinimum": 0.5, "exclusiveMaximum": 2},
         [("0.50000000000000001", False), ("0.5000000000000001", True), ("1", True),
          ("1.9999999999999999", False), ("1.9999999999999998", True), ("2", False)]),
        ({"type": ["number", "null"], "exclusiveMinimum": -1e-5},
         [("-0.000009999999999999999999", False), ("-9.9999999999999999999e-6", False),
          ("-9.999999999999999e-6", True), ("0", True)]),
    ],
)  # fmt: skip
def test_a_number_under_an_exclusive_bound_is_past_it_as_a_double(schema, answers):
    """The grammar compared decimals exactly, so 0.50000000000000001 passed exclusiveMinimum 0.5;
    json.loads (and JavaScript, and jsonschema) reads it as 0.5, which breaks the bound."""
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from kvserve.structured.json_strings import json_schema_grammar

    validator = jsonschema.Draft202012Validator(schema)
    assert [(t, validator.is_valid(json.loads(t))) for t, _ in answers] == answers
    grammar = json_schema_grammar(json.dumps(schema))
    assert [(t, accepts(grammar, t)) for t, _ in answers] == answers


def test_a_long_pattern_is_written_in_short_rules():
    """A pattern's characters were each an inline group of their JSON spellings, all in one rule:
    xgrammar's compile of such a rule grows with the square of its length (2,000 random characters
    on a 25k-token vocabulary: 1.0 s, 10,000: 36 s). Each spelling is now one named rule and a
    long sequence is cut into named pieces: no rule grows with the pattern, and the grammar still
    takes the text, its \\u escapes, and nothing else."""
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from kvserve.structured.json_patterns import pattern_grammar
    from kvserve.structured.json_strings import json_schema_grammar

    rnd = random.Random(0)
    body = "".join(rnd.choice("abcdefghijklmnopqrstuvwxyz0123456789-_ ") for _ in range(2000))
    pattern = "^" + body + "(x|[0-9]{2})$"
    rules = pattern_grammar(pattern, "p").splitlines()
    assert max(map(len, rules)) < 1000, max(map(len, rules))  # one rule of 77,381 characters before
    grammar = json_schema_grammar(json.dumps({"type": "string", "pattern": pattern}))
    escaped = json.dumps(body).replace("a", "\\u0061")
    answers = [(body + "x", True), (body + "42", True), (body[:-1] + "x", False), (body + "xx", False)]
    for text, valid in answers:
        assert accepts(grammar, json.dumps(text)) == valid, text[-5:]
    assert accepts(grammar, escaped[:-1] + '07"')


def test_a_deprecated_guided_field_is_named_in_its_error():
    """guided_json's invalid schema was reported as structured_outputs', a field never sent."""
    base = {"messages": [{"role": "user", "content": "x"}]}
    for field, value, says in [
        ("guided_json", "[1,", "guided_json: invalid json schema: the schema is not valid JSON"),
        ("guided_regex", "(", "guided_regex: invalid regex: Regex parsing error"),
        ("guided_grammar", "root ::= nope", "guided_grammar: invalid grammar: EBNF parser error at line 1"),
        ("guided_choice", [], "guided_choice: choice must be a non-empty list"),
    ]:
        req = ChatCompletionRequest(**base, **{field: value})
        normalize_chat(req)
        with pytest.raises(ValueError) as e:
            req.output_constraint()
        assert str(e.value).startswith(says), str(e.value)
    assert normalize_chat(ChatCompletionRequest(**base, guided_regex="a+"))  # a Warning, no error


def test_a_boolean_schema_is_a_schema():
    """JSON Schema's true (any value) and false (none) given as Python's bools reached the check
    unserialized: "the JSON object must be str, bytes or bytearray, not bool"."""
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from kvserve.structured.json_strings import json_schema_grammar

    check(S(json=True))
    grammar = json_schema_grammar(S(json=True).json)
    assert all(accepts(grammar, t) for t in ("1", '{"a": [null]}', '"x"'))
    with pytest.raises(ValueError, match="invalid json schema: Schema 'false' cannot accept any value"):
        check(S(json=False))


def test_params_need_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        S()
    with pytest.raises(ValueError, match="exactly one"):
        S(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="choice"):
        S(choice=[])
    check(S(choice=['say "hi"', "a\\b", "naïve\n"]))  # escaped into valid EBNF literals
    assert grammar_key(S(json={"b": 1, "a": 2})) == ("json", '{"b": 1, "a": 2}')  # order kept


def test_response_format_translation():
    base = {"messages": [{"role": "user", "content": "x"}]}
    req = ChatCompletionRequest(**base, response_format={"type": "json_object"})
    assert req.output_constraint() == S(json_object=True)
    req = ChatCompletionRequest(
        **base,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}},
    )
    assert req.output_constraint().json == '{"type": "object"}'
    assert ChatCompletionRequest(**base, response_format={"type": "text"}).output_constraint() is None
    bad = ChatCompletionRequest(
        **base,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "foo"}}},
    )
    with pytest.raises(ValueError, match=r"^response_format: invalid json schema"):
        bad.output_constraint()
    with pytest.raises(ValueError, match="cannot be combined"):
        ChatCompletionRequest(
            **base, response_format={"type": "json_object"}, structured_outputs={"regex": "a"}
        ).output_constraint()


def test_tool_modes_and_constraints():
    base = {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS}
    assert tool_mode(ChatCompletionRequest(**base)) == "auto"
    named = ChatCompletionRequest(**base, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert tool_mode(named) == "named"
    assert json.loads(call_constraint(named, "named").json) == {"type": "object"}
    req = ChatCompletionRequest(**base, tool_choice="required", parallel_tool_calls=False)
    schema = json.loads(call_constraint(req, "required").json)
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    with pytest.raises(ValueError, match="not among the tools"):
        tool_mode(
            ChatCompletionRequest(**base, tool_choice={"type": "function", "function": {"name": "nope"}})
        )
    with pytest.raises(ValueError, match="requires tools"):
        tool_mode(ChatCompletionRequest(messages=base["messages"], tool_choice="required"))


def test_required_calls_keep_their_tools_local_refs():
    """tool_choice "required" nested each tool's parameters in an array schema, where their local
    $refs (pydantic's "#/$defs/City", a recursive "#") pointed at the array: a 400 "Cannot find
    field $defs in #/$defs/City", though the tool forced by name was answered."""
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from kvserve.structured.json_strings import json_schema_grammar

    trip = {
        "$defs": {
            "City": {
                "type": "object",
                "properties": {"name": {"type": "string"}},
                "required": ["name"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "required": ["city", "next"],
        "additionalProperties": False,
        "properties": {
            "city": {"$ref": "#/$defs/City"},
            "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
        },
    }
    tools = [*TOOLS, {"type": "function", "function": {"name": "trip", "parameters": trip}}]
    req = ChatCompletionRequest(
        messages=[{"role": "user", "content": "x"}], tools=tools, tool_choice="required"
    )
    grammar = json_schema_grammar(call_constraint(req, "required").json)
    rome = '{"city": {"name": "Rome"}, "next": null}'
    ok = '[{"name": "trip", "arguments": {"city": {"name": "Oslo"}, "next": ' + rome + "}}]"
    assert accepts(grammar, ok) and accepts(
        grammar, '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    )
    assert not accepts(grammar, '[{"name": "trip", "arguments": {"city": "Oslo", "next": null}}]')
    assert not accepts(grammar, '[{"name": "get_weather", "arguments": {"city": {"name": "Oslo"}}}]')


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "count"}}])
def test_a_forced_tools_bad_parameters_are_named_by_tool_and_pointer(choice):
    """A forced call's refusal pointed into the wrapper built around the tools ("maximum at
    /items/anyOf/2/properties/arguments/properties/n") and named the field only "tools"."""
    bad = {
        "type": "function",
        "function": {
            "name": "count",
            "parameters": {
                "type": "object",
                "properties": {"n": {"type": "integer", "minimum": 2, "maximum": 1}},
            },
        },
    }
    messages = [{"role": "user", "content": "x"}]
    req = ChatCompletionRequest(messages=messages, tools=[*TOOLS, bad], tool_choice=choice)
    with pytest.raises(ValueError) as e:
        call_constraint(req, tool_mode(req))
    assert str(e.value) == (
        "tools: function 'count' parameters: invalid json schema: maximum at /properties/n: no integer is "
        "at least 2 and at most 1"
    )


def test_conversation_without_native_tool_support():
    req = ChatCompletionRequest(
        messages=[
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "c1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "12C"},
        ],
        tools=TOOLS,
    )  # fmt: skip
    messages, kwargs = conversation(req, "{{ m['content'] }}")
    assert kwargs == {} and messages[0]["role"] == "system" and "<tools>" in messages[0]["content"]
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
        == messages[2]["content"]
    )
    assert messages[3] == {"role": "tool", "content": "12C", "tool_call_id": "c1"}
    messages, kwargs = conversation(req, "{% for t in tools %}{% endfor %}")
    assert kwargs["tools"][0]["function"]["name"] == "get_weather"
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}


def test_conversation_with_legacy_function_turns():
    """A `functions` conversation round-trips: the assistant's function_call renders as a tool
    call and the `function` message as a tool result carrying its name."""
    ask = {"role": "user", "content": "weather?"}
    call = {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    legacy = ChatCompletionRequest(
        messages=[ask, {"role": "assistant", "content": None, "function_call": call},
                  {"role": "function", "name": "get_weather", "content": "12C"}],
        functions=[TOOLS[0]["function"]],
    )  # fmt: skip
    tools = ChatCompletionRequest(
        messages=[ask, {"role": "assistant", "content": None,
                        "tool_calls": [{"id": "c1", "type": "function", "function": call}]},
                  {"role": "tool", "tool_call_id": "c1", "content": "12C"}],
    )  # fmt: skip
    for template in ("{{ m['content'] }}", "{% for t in tools %}{% endfor %}"):
        messages, _ = conversation(legacy, template)
        want, _ = conversation(tools, template)
        assert messages[2] == {"role": "tool", "content": "12C", "name": "get_weather"}
        if "tool_calls" in want[1]:  # native: the same call, less the id a legacy call lacks
            want[1]["tool_calls"][0]["id"] = None
        assert messages[1] == want[1] and "Oslo" in json.dumps(messages[1])
    nameless = ChatCompletionRequest(messages=[ask, {"role": "function", "content": "12C"}])
    with pytest.raises(ValueError, match=r"message 1 \(function\) needs name"):
        conversation(nameless, "")
    both = ChatCompletionRequest(
        messages=[{"role": "assistant", "function_call": call,
                   "tool_calls": [{"id": "c1", "type": "function", "function": call}]}],
    )  # fmt: skip
    with pytest.raises(ValueError, match="both tool_calls and function_call"):
        conversation(both, "")


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', None, [("f", '{"a": 1}')]),
        ('Sure.\n<tool_call>[{"name": "f", "arguments": {}}, '
         '{"name": "g", "arguments": {"b": "x"}}]</tool_call>', "Sure.", [("f", "{}"), ("g", '{"b": "x"}')]),
        ('{"name": "f", "parameters": {"a": 2}}', None, [("f", '{"a": 2}')]),  # Llama 3
        ("just text", "just text", []),
        ("<tool_call>{broken", "<tool_call>{broken", []),
    ],
)  # fmt: skip
def test_auto_parsing(text, content, calls):
    got_content, got = parse_calls(text, "auto", declared={"f", "g"})
    assert got_content == content and [(c.name, c.arguments) for c in got] == calls


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "John", "age": 3}',  # a json_schema answer, with tools declared
        '<tool_call>{"name": "h", "arguments": {}}</tool_call>',
        'Both: <tool_call>[{"name": "f", "arguments": {}}, {"name": "John"}]</tool_call>',
        '{"name": {"first": "f"}}',
    ],
)
def test_auto_calls_only_declared_tools(text):
    """A name that is no declared tool makes the text an answer, not a call."""
    assert parse_calls(text, "auto", declared={"f", "g"}) == (text, [])


def test_required_array_parsing_and_prefixes():
    text = '[{"name": "f", "arguments": {"s": "a}\\"b", "n": [1, {"x": 2}]}}, {"name": "g", "arguments": {}}]'
    _, calls = parse_calls(text, "required")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("f", {"s": 'a}"b', "n": [1, {"x": 2}]}),
        ("g", {}),
    ]
    assert json_value_end('{"a": "}"} tail', 0) == len('{"a": "}"}')
    for cut in range(len(text)):  # every prefix parses to prefixes of the final calls
        for p, full in zip(parse_calls(text[:cut], "required")[1], calls):
            assert p.name == full.name and full.arguments.startswith(p.arguments)


@pytest.mark.parametrize("tail", ["", ",", ', "argu', ', "arguments"', ', "arguments": '])
def test_a_forced_call_cut_after_its_name_is_returned_with_no_arguments_yet(tail):
    """max_tokens cutting a forced ("required") call between its name and its arguments left the
    reply with no call at all: the call is returned with its name and arguments "" (finish
    "length"), streamed as its first delta; a name cut short is no call yet. An "auto" call cut
    there was left out while the forced one was returned: it is returned the same way."""
    head = '[{"name": "f"'
    _, calls = parse_calls(head + tail, "required", cut=True)
    assert [(c.name, c.arguments) for c in calls] == [("f", "")]
    assert parse_calls(head[:-2], "required", cut=True)[1] == []
    _, streamed = _streamed(ToolCallStream("required"), [head[:5], head[5:] + tail])
    assert [(c["name"], c["arguments"]) for c in streamed] == [("f", "")]
    text = '[{"name": "f", "arguments": {}}, {"name": "g"' + tail
    calls = parse_calls(text, "required", cut=True)[1]
    assert [(c.name, c.arguments) for c in calls] == [("f", "{}"), ("g", "")]
    block = 'Checking.\n<tool_call>\n{"name": "f"' + tail
    assert parse_calls(block, "auto", declared={"f"}, cut=True) == ("Checking.", [ParsedCall("f", "")])
    content, streamed = _streamed(ToolCallStream("auto", declared={"f"}), [block[:14], block[14:]], cut=True)
    assert content == "Checking." and [(c["name"], c["arguments"]) for c in streamed] == [("f", "")]
    assert parse_calls('<tool_call>{"name": "f", "x": 1', "auto", declared={"f"}, cut=True) == (None, [])


@pytest.mark.parametrize("mode", ["required", "named", "auto"])
def test_streamed_deltas_reassemble(mode):
    text = {
        "required": '[{"name": "f", "arguments": {"a": [1, 2]}}, {"name": "g", "arguments": {"b": "}"}}]',
        "named": '{"city": "Paris"}',
        "auto": 'Let me check. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>',
    }[mode]
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    content, calls = _streamed(ToolCallStream(mode, "get_weather", declared={"f", "g"}), pieces)
    want_content, want = parse_calls(text, mode, "get_weather", {"f", "g"})
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in want] != []
    assert all(c["id"].startswith("call_") for c in calls)
    assert content == (want_content or "")


def _streamed(stream: ToolCallStream, pieces: list[str], cut: bool = False) -> tuple[str, list[dict]]:
    """The content and calls that a client reassembles from the stream's deltas (`cut`: the
    last piece ends the text at max_tokens)."""
    content, calls = "", {}
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        c, deltas = stream.feed(piece, last, cut=cut and last)
        content += c
        for d in deltas:
            entry = calls.setdefault(d["index"], {"id": d.get("id"), "name": "", "arguments": ""})
            assert "id" not in d or entry["id"] == d["id"]
            entry["name"] += d["function"].get("name") or ""
            entry["arguments"] += d["function"]["arguments"]
    return content, list(calls.values())


CALL = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'


@pytest.mark.parametrize(
    "text",
    [
        f"Sure!\n{CALL}\nDone.",  # text after the call
        f"  Checking.  {CALL}  and  {CALL.replace('f', 'g')}  done  ",  # between, and spaces
        f"{CALL}\n\n",
        "  Just an answer, <tool_ no call.\n",
        f"First {CALL} then <tool_call>{{broken",  # a block that is no call: all is content
        f"Ask {CALL.replace('f', 'h')} later",  # h is no declared tool
        '{"name": "John", "age": 3}',
        ' {"name": "g", "parameters": {"b": 2}} ',
    ],
)
@pytest.mark.parametrize("split", ["chars", "words"])
def test_auto_stream_matches_the_whole_text(text, split):
    """Streamed or not, "auto" makes the same content and calls of the same text."""
    pieces = list(text) if split == "chars" else re.findall(r"\s+|\w+|[^\w\s]+", text)
    assert "".join(pieces) == text
    content, calls = _streamed(ToolCallStream("auto", declared={"f", "g"}), pieces)
    want_content, want = parse_calls(text, "auto", declared={"f", "g"})
    assert content == (want_content or "")
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in want]
