"""Schema keywords xgrammar would not enforce are refused (structured/schema_support.py), and
each refusal is still needed: xgrammar's grammar accepts what the keyword forbids."""

from __future__ import annotations

import json
import re
import time

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string as accepts

from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured.spec import check

INTS = {"type": "array", "items": {"type": "integer"}}
# (schema, a JSON text the schema forbids, the keyword, where)
IGNORED = [
    ({**INTS, "uniqueItems": True}, "[1, 1]", "uniqueItems", "/"),
    ({**INTS, "contains": {"minimum": 5}}, "[1]", "contains", "/"),
    ({"not": {"type": "string"}}, '"x"', "not", "/"),
    ({"if": {"type": "string"}, "then": {"minLength": 2}}, '"x"', "if", "/"),
    ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, "1", "allOf", "/"),
    (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "dependentRequired": {"a": ["b"]},
        },
        '{"a": 1}',
        "dependentRequired",
        "/",
    ),  # fmt: skip
    (
        {"type": "object", "properties": {"tags": {**INTS, "uniqueItems": True}}},
        '{"tags": [1, 1]}',
        "uniqueItems",
        "/properties/tags",
    ),  # fmt: skip
    (
        {"$defs": {"N": {"not": {"type": "null"}}}, "anyOf": [{"$ref": "#/$defs/N"}]},
        "null",
        "not",
        "/$defs/N",
    ),
    # a name two patterns with unlike schemas define would need both schemas at once
    (
        {"type": "object", "patternProperties": {"^a": INTS, "a$": {"type": "string"}}, "required": ["a"]},
        "{}",
        "required",
        "/",
    ),
    # a name two patterns match (or a property and a pattern) must meet both schemas: one was enforced
    (
        {"type": "object", "patternProperties": {"a.*": INTS, ".*b": {"type": "string"}}},
        '{"ab": [1]}',
        "patternProperties",
        "/",
    ),
    (
        {"type": "object", "properties": {"ab": {"type": "string"}}, "patternProperties": {"a.": INTS}},
        '{"ab": "x"}',
        "patternProperties",
        "/",
    ),
    (
        {
            "type": "object",
            "properties": {
                "o": {"type": "object", "patternProperties": {"^x\\d+$": INTS, "\\d{3}": {"type": "integer"}}}
            },
        },
        '{"o": {"x123": [1]}}',
        "patternProperties",
        "/properties/o",
    ),  # fmt: skip
    # no alternative at all: an empty answer (and '{"a": }' inside an object) was answered, with "stop"
    ({"anyOf": []}, "", "anyOf", "/"),
    (
        {"type": "object", "properties": {"a": {"oneOf": []}}, "required": ["a"]},
        '{"a": }',
        "oneOf",
        "/properties/a",
    ),  # fmt: skip
    # oneOf is written as anyOf: a value both branches match was answered (exactly one must)
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "1", "oneOf", "/"),
    ({"oneOf": [{"type": "string"}, {"type": "string", "format": "email"}]}, '"a@b.co"', "oneOf", "/"),
    (
        {"type": "object", "properties": {"v": {"oneOf": [{"enum": [1, 2]}, {"enum": [2.0, 3]}]}}},
        '{"v": 2}',
        "oneOf",
        "/properties/v",
    ),
    (
        {
            "oneOf": [
                {
                    "type": "object",
                    "properties": {"a": INTS},
                    "required": ["a"],
                    "additionalProperties": True,
                },
                {"type": "object", "required": ["b"]},
            ]
        },
        '{"a": [1], "b": 2}',
        "oneOf",
        "/",
    ),  # fmt: skip
    # multipleOf is enforced on integers only: 1.25 answered a multiple of 0.5
    ({"type": "number", "multipleOf": 0.5}, "1.25", "multipleOf", "/"),
    ({"type": "object", "properties": {"n": {"multipleOf": 3}}}, '{"n": 4}', "multipleOf", "/properties/n"),
    # beside a bound xgrammar drops multipleOf (a log warning): 4 was answered; listed where both bounds allow
    ({"type": "integer", "multipleOf": 3, "minimum": 0}, "4", "multipleOf", "/"),
    ({"type": "integer", "multipleOf": 3, "minimum": 0, "maximum": 10**6}, "4", "multipleOf", "/"),
    # of a string's format, pattern and length bounds one is enforced: the format, else the pattern
    ({"type": "string", "pattern": "^a+$", "minLength": 3}, '"a"', "minLength", "/"),
    ({"type": "string", "pattern": "^a{1,5}$", "maxLength": 2}, '"aaaa"', "maxLength", "/"),
    ({"type": "string", "format": "date", "maxLength": 3}, '"2024-01-01"', "format", "/"),
    (
        {"type": "string", "pattern": "^a+$", "minLength": 2, "format": "date-time"},
        '"2024-01-01T00:00:00Z"',
        "format",
        "/",
    ),  # fmt: skip
    # enum and const are written alone: the keywords beside them were not enforced
    ({"type": "string", "enum": ["aaaa", "b"], "maxLength": 2}, '"aaaa"', "enum", "/"),
    ({"type": "integer", "enum": [1, "a"]}, '"a"', "enum", "/"),
    ({"type": "number", "enum": [1, 50], "maximum": 5}, "50", "enum", "/"),
    (
        {"type": "object", "properties": {"c": {"const": "x", "pattern": "^y"}}},
        '{"c": "x"}',
        "const",
        "/properties/c",
    ),
    # a lookahead group in a pattern is dropped (with a log warning): "a" was answered
    ({"type": "string", "pattern": "^(?!a)[a-z]$"}, '"a"', "pattern", "/"),
    (
        {"type": "object", "properties": {"id": {"type": "string", "pattern": "^(?=z)[xy]$"}}},
        '{"id": "y"}',
        "pattern",
        "/properties/id",
    ),  # fmt: skip
    # a string's, number's or array's keyword with no type beside it: any value was written
    ({"type": "object", "properties": {"a": {"pattern": "^a$"}}}, '{"a": "b"}', "pattern", "/properties/a"),
    ({"minimum": 5}, "1", "minimum", "/"),
    ({"maxLength": 2}, '"bbb"', "maxLength", "/"),
    ({"format": "date"}, '"x"', "format", "/"),
    ({"maxItems": 1}, "[1, 2]", "maxItems", "/"),
    ({"anyOf": [{"type": "string"}], "pattern": "^a$"}, '"b"', "pattern", "/"),
]


@pytest.mark.parametrize("schema, forbidden, keyword, where", IGNORED)
def test_a_keyword_xgrammar_ignores_is_refused_naming_it(schema, forbidden, keyword, where):
    assert accepts(xgr.Grammar.from_json_schema(json.dumps(schema)), forbidden)  # still ignored
    expected = f"structured_outputs: invalid json schema: {keyword} at {where} is not supported"
    with pytest.raises(ValueError, match=re.escape(expected)):
        check(StructuredOutputsParams(json=schema))


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"not": {"type": "string"}, "if": {"type": "integer"}}},  # names
        {"allOf": [{"$ref": "#/$defs/A"}], "$defs": {"A": {"type": "integer"}}},  # one allOf schema
        {**INTS, "uniqueItems": False, "minItems": 1, "maxItems": 3},
        {"type": "string", "pattern": "^[A-Z]{2}$", "minLength": 2, "maxLength": 2},  # implied by the pattern
        {"type": "string", "pattern": "^a+$", "format": "iri"},  # a format xgrammar ignores
        {"type": "string", "format": "date-time"},
        {"items": {"type": "integer"}, "maxItems": 1, "minItems": 1},  # items: an array, its counts enforced
        {"format": "color", "description": "a format xgrammar ignores, with or without a type"},
        {"type": "object", "propertyNames": {"pattern": "^a"}},  # names are strings: enforced
        {"type": "integer", "multipleOf": 3},
        {"type": "string", "enum": ["ab", "c"], "maxLength": 2, "pattern": "^[a-c]+$", "description": "x"},
        {"type": ["integer", "null"], "enum": [1, None, 2.0], "minimum": 1, "exclusiveMaximum": 3},
        {"enum": [True, "x", [1, 2]], "minimum": 5, "maxLength": 1},  # bounds for other types
        {"type": "string", "pattern": "^[(?=]+(?:x)$"},  # literal "(?=" in a class; a non-capturing group
        {"type": "object", "properties": {"a": INTS}, "required": ["a"]},
        {"type": "object", "patternProperties": {"^a": INTS, "a$": INTS}, "required": ["a"]},  # alike
        {"type": "object", "patternProperties": {"^S_": {"type": "string"}, "^I_": INTS}},  # exclusive
        {"type": "object", "patternProperties": {"^[a-z]+$": INTS, "^\\d+$": {"type": "string"}}},
        {"type": "object", "properties": {"ab": INTS}, "patternProperties": {"a.": {}, "^x": INTS}},
        {
            "type": "object",
            "patternProperties": {"^a$": INTS},
            "required": ["a"],
            "additionalProperties": False,
        },
        # a repeated unlisted name cannot make up minProperties: the required names leave one at most
        {"type": "object", "minProperties": 1},
        {"type": "object", "required": ["a", "b"], "minProperties": 3, "additionalProperties": INTS},
        {"type": "object", "properties": {"a": INTS, "b": INTS, "c": INTS}, "minProperties": 2},  # closed
        # oneOf branches no one value can match both of: anyOf is exact
        {"oneOf": [{"type": "integer"}, {"type": "string"}, {"type": ["null", "boolean"]}]},
        {"oneOf": [{"const": "a"}, {"const": "b"}, {"enum": [True]}, {"enum": [1, [1]]}]},
        {"oneOf": [{"type": "integer", "maximum": 0}, {"type": "number", "exclusiveMinimum": 0}]},
        {"oneOf": [{"type": "string", "pattern": "^a+$"}, {"type": "string", "pattern": "b"}]},
        {"oneOf": [{"type": "object", "properties": {"a": INTS}, "required": ["a"]},
                   {"type": "object", "properties": {"b": INTS}, "required": ["b"]}]},  # closed objects
        {"oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}], "$defs": {  # a discriminator
            "Cat": {"type": "object", "properties": {"kind": {"const": "cat"}}, "required": ["kind"],
                    "additionalProperties": True},
            "Dog": {"type": "object", "properties": {"kind": {"type": "string", "enum": ["dog"]}},
                    "required": ["kind"], "additionalProperties": True}}},
    ],
)  # fmt: skip
def test_what_xgrammar_enforces_is_accepted(schema):
    check(StructuredOutputsParams(json=schema))


@pytest.mark.parametrize(
    "schema, why",
    [
        ({"type": "object", "minProperties": 1, "additionalProperties": False},
         "minProperties at /: minProperties is 1, but additionalProperties is false and properties"),
        ({"type": "object", "properties": {"p": {"type": "array", "prefixItems": [INTS], "minItems": 2,
                                                 "items": False}}},
         "minItems at /properties/p: minItems is 2, but items is false and prefixItems lists 1"),
        ({"type": "object", "properties": {}, "required": ["a"], "additionalProperties": False},
         "required at /: the required property 'a' is not defined in properties and additionalProperties"),
    ],
)  # fmt: skip
def test_a_schema_closed_by_its_own_false_below_its_minimum_is_refused_in_our_words(schema, why):
    """xgrammar refused the first two with its own text ("additional properties aren't allowed:
    1 > 0") and answered the third `{}`; no value meets any of them: a 400 naming the keyword."""
    with pytest.raises(ValueError) as e:
        check(StructuredOutputsParams(json=schema))
    assert str(e.value).startswith(f"structured_outputs: invalid json schema: {why}"), str(e.value)
    assert "allowed:" not in str(e.value)


@pytest.mark.parametrize(
    "schema, why",
    [
        ({"type": "integer", "exclusiveMinimum": 0.12, "exclusiveMaximum": 1},
         "exclusiveMaximum at /: no integer is above 0.12 and below 1"),
        ({"type": "object", "properties": {"a": {"type": "integer", "minimum": 0.2, "maximum": 0.8}}},
         "maximum at /properties/a: no integer is at least 0.2 and at most 0.8"),
        ({"type": "number", "minimum": 2, "exclusiveMinimum": 2.5, "maximum": 2.5},
         "maximum at /: no number is above 2.5 and at most 2.5"),
        ({"type": "array", "items": {"type": "number", "exclusiveMinimum": 0, "maximum": 1e-310}},
         "maximum at /items: no number is above 0 and at most 1e-310 that a double reads as itself"),
        ({"type": "number", "exclusiveMinimum": 1, "exclusiveMaximum": 1.0000000000000002},  # next double
         "exclusiveMaximum at /: no number is above 1 and below 1.0000000000000002 that a double reads as"),
    ],
)  # fmt: skip
def test_bounds_that_leave_no_number_are_refused_naming_them(schema, why):
    """A bounded number is a placeholder in the check's xgrammar conversion (number_forms.py),
    which hid xgrammar's "Invalid range": these passed the check, their compile then failed in
    the engine and the request answered nothing, finish_reason "abort"."""
    with pytest.raises(ValueError) as e:
        check(StructuredOutputsParams(json=schema))
    assert str(e.value).startswith(f"structured_outputs: invalid json schema: {why}"), str(e.value)
    check(StructuredOutputsParams(json={"type": "integer", "minimum": 0.5, "maximum": 1}))  # 1 meets it


def test_a_draft4_boolean_exclusive_bound_is_refused_naming_it():
    """OpenAPI 3.0 and draft 4 write an exclusive bound as a flag beside minimum / maximum; the
    400 was xgrammar's "Value must be a number", naming neither the keyword nor where it was."""
    number = {"type": "number", "maximum": 1, "exclusiveMaximum": True}
    schema = {"type": "object", "properties": {"n": number}}
    with pytest.raises(ValueError) as e:
        check(StructuredOutputsParams(json=schema))
    assert str(e.value) == (
        "structured_outputs: invalid json schema: exclusiveMaximum at /properties/n is not supported: "
        "exclusiveMaximum is true, draft 4's flag on maximum; give the bound itself (draft 6 on), "
        '"exclusiveMaximum": <number> in place of the flag and "maximum"'
    )


def _kinds(n: int, extra: dict | None = None) -> dict:
    """A oneOf of n closed objects told apart by a discriminator's const."""
    branch = lambda i: {"type": "object", "properties": {"k": {"const": f"v{i}"}, **(extra or {})},  # noqa: E731
                        "required": ["k"], "additionalProperties": False}  # fmt: skip
    return {"oneOf": [branch(i) for i in range(n)]}


def test_a_oneof_too_wide_to_prove_exclusive_is_refused_at_once():
    """Each pair of a oneOf's branches is compared: 800 branches took 20 s of the API process's CPU
    (2,000 several minutes); past 256 branches (65,280 pairs, in all of a schema's oneOfs) it is
    refused naming oneOf, before any pair is compared."""
    check(StructuredOutputsParams(json=_kinds(256)))
    start = time.monotonic()
    with pytest.raises(ValueError) as e:
        check(StructuredOutputsParams(json=_kinds(2000)))
    assert time.monotonic() - start < 30  # (the pairs compared: minutes; refused: 2-4.6 s at load 11)
    why = "oneOf at / is not supported: proving its 2000 schemas exclusive compares 3,998,000 pairs"
    assert str(e.value).startswith(f"structured_outputs: invalid json schema: {why}"), e.value
    two = {"type": "object", "properties": {"a": _kinds(200), "b": _kinds(100)}}  # 39,800 + 9,900 pairs: fine
    check(StructuredOutputsParams(json=two))
    two["properties"]["c"] = _kinds(130)  # + 16,770: past the schema's pairs
    with pytest.raises(ValueError, match="oneOf at /properties/c is not supported: proving its 130"):
        check(StructuredOutputsParams(json=two))


def test_a_oneof_proved_exclusive_logs_no_anyof_fallback(capfd):
    """xgrammar logged "falling back to anyOf semantics" for every oneOf it could not prove
    exclusive itself, though kvserve had (a closed object's unlisted name): wrong for a reader of
    the log. Its other warnings are still logged."""
    from kvserve.structured.json_strings import json_schema_grammar

    closed = lambda n: {"type": "object", "properties": {n: {"type": "string"}}, "required": [n],  # noqa: E731
                        "additionalProperties": False}  # fmt: skip
    schema = {"type": "object", "properties": {"v": {"oneOf": [closed("a"), closed("b")]}}}
    capfd.readouterr()
    check(StructuredOutputsParams(json=schema))
    grammar = json_schema_grammar(json.dumps(schema))
    assert accepts(grammar, '{"v": {"b": "x"}}') and not accepts(grammar, '{"v": {}}')
    assert "anyOf" not in capfd.readouterr().err
    xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)  # xgrammar's own words
    assert "falling back to anyOf" in capfd.readouterr().err


@pytest.mark.parametrize(
    "schema, why",
    [({"type": "integer", "minimum": -1e20, "multipleOf": 5},
      "multipleOf at / is not supported: a whole multipleOf"),
     ({"type": "integer", "minimum": 10**20, "maximum": 10**20 + 5000, "multipleOf": 1},
      "multipleOf at / is not supported: a whole multipleOf beside bounds past 64-bit integers")],
)  # fmt: skip
def test_a_multiple_of_beside_a_bound_past_64_bits_is_refused_in_our_words(schema, why):
    """xgrammar's conversion ran first and refused the bound in its words ("Integer exceeds minimum
    limit"), naming no keyword; the multipleOf kvserve cannot enforce there is named instead."""
    with pytest.raises(ValueError) as e:
        check(StructuredOutputsParams(json=schema))
    assert str(e.value).startswith(f"structured_outputs: invalid json schema: {why}"), str(e.value)


def test_an_untyped_array_with_items_has_its_counts_enforced():
    """items make xgrammar write an array, so minItems / maxItems beside them are kept (not refused)."""
    grammar = xgr.Grammar.from_json_schema(
        json.dumps({"items": {"type": "integer"}, "maxItems": 1, "minItems": 1})
    )
    assert accepts(grammar, "[1]") and not accepts(grammar, "[1, 2]") and not accepts(grammar, "[]")
