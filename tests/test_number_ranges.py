"""number_ranges.py's grammar against exact decimal arithmetic: every numeral of a grid that
it accepts is within the bounds, and every plain or one-digit scientific numeral within them is
accepted (a bound of any size, a fraction of any length)."""

from __future__ import annotations

import re
from decimal import Decimal

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string as accepts

from kvserve.structured.number_ranges import number_ebnf, schema_bounds

BOUNDS = [{"maximum": 1e30}, {"minimum": -1e20}, {"minimum": 0, "maximum": 1}, {"exclusiveMaximum": 3},
          {"minimum": 2, "maximum": 2.5}, {"exclusiveMinimum": 2, "exclusiveMaximum": 2.5},
          {"minimum": 0.01, "maximum": 250}, {"exclusiveMinimum": 0}, {"minimum": 1.5e-3},
          {"maximum": -0.25}, {"minimum": 10**20, "exclusiveMaximum": 10**21},
          {"minimum": 2.5, "maximum": 2.5},
          {"exclusiveMinimum": -1, "exclusiveMaximum": 1}, {"minimum": 1, "maximum": 1.0001},
          {"minimum": -(2**70), "maximum": 2**64}]  # fmt: skip
BASES = ["0", "1", "2", "2.5", "2.49999999", "2.50000001", "3", "0.25", "0.0015", "0.00149", "0.01", "0.009",
         "1.0001", "1.00011", "250", "250.0000001", "99", "100000000000000000000", "99999999999999999999.9",
         "1000000000000000000000", "18446744073709551616", "1180591620717411303424",
         "1000000000000000000000000000000"]  # fmt: skip
SCIENTIFIC = ["1e30", "1E+30", "1.0000001e30", "9.9e29", "1e20", "1e21", "2.5e0", "2.5E-0", "1.5e-3",
              "1.49e-3", "2.5e-1", "1e-7", "1e0", "3e0", "0e7", "0.0e-3", "25e-1", "0.1e1"]  # fmt: skip
NUMERALS = BASES + ["-" + b for b in BASES] + SCIENTIFIC + ["-" + s for s in SCIENTIFIC]
INTEGER = re.compile(r"-?(0|[1-9][0-9]*)")
# Forms the grammar is exact for; others it may refuse within the bounds (docs: their limit).
EXACT_FORM = re.compile(
    r"-?((0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?0+)?|[1-9](\.[0-9]+)?[eE][+-]?[0-9]+|0(\.0+)?[eE].*)"
)


@pytest.mark.parametrize("integer", [False, True])
@pytest.mark.parametrize("bounds", BOUNDS, ids=str)
def test_numerals_are_accepted_exactly_when_within_the_bounds(bounds, integer):
    low, high = schema_bounds(bounds)
    ebnf = number_ebnf(integer, low, high)
    numerals = [n for n in NUMERALS if INTEGER.fullmatch(n)] if integer else NUMERALS
    inside = [_within(Decimal(n), low, high) for n in numerals]
    if ebnf is None:
        assert not any(inside)
        return
    grammar = xgr.Grammar.from_ebnf(f"root ::= {ebnf}")
    for numeral, want in zip(numerals, inside):
        got = accepts(grammar, numeral)
        assert got == want or (not got and not EXACT_FORM.fullmatch(numeral)), (bounds, numeral, got)


def _within(v, low, high) -> bool:
    above = low is None or v > low.value or (v == low.value and low.inclusive)
    return above and (high is None or v < high.value or (v == high.value and high.inclusive))
