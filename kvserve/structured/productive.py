"""Whether a parsed xgrammar Grammar can derive any finite text at all.

A grammar such as `root ::= "a" root` parses and even allows a first byte, yet no derivation
ever ends: a request constrained by it can only stop at max_tokens. The classic test for an
empty context-free language is productivity: a rule is productive when one of its
alternatives is made only of terminals and productive rules; the language is empty exactly
when root is not productive. It runs over xgrammar's own normalized form (what
`Grammar.serialize_json` writes), so EBNF sugar (`*`, `+`, `?`, `{m,n}`, groups) is already
rewritten into rules, choices, sequences and repeats by xgrammar's parser.

The serialized form is xgrammar's internal format: anything this module does not know (a new
format version, an unknown expression type) counts as productive, so the check can miss an
empty language but never refuses a usable one.
"""

from __future__ import annotations

import json
from typing import Any

# GrammarExprType as xgrammar 0.2.x numbers it (format "v16").
_BYTE_STRING, _CHAR_CLASS, _CHAR_CLASS_STAR, _EMPTY, _RULE_REF, _SEQUENCE, _CHOICES = range(7)
_REPEAT = 8
_KNOWN_FORMATS = {"v16"}
_MAX_CODEPOINT = 0x10FFFF


def unproductive_root(grammar: Any) -> bool:
    """True when no finite text derives from the grammar's root (its language is empty)."""
    try:
        data = json.loads(grammar.serialize_json())
        if data.get("__VERSION__") not in _KNOWN_FORMATS:
            return False
        return _Analysis(data).root_unproductive()
    except (AttributeError, KeyError, IndexError, TypeError, ValueError):
        return False  # a format we cannot read: never refuse on a guess


class _Analysis:
    def __init__(self, data: dict) -> None:
        flat: list[int] = data["grammar_expr_data"]
        self.exprs = [_decode(flat, start) for start in data["grammar_expr_indptr"]]
        self.bodies: list[int] = [rule[1] for rule in data["rules"]]
        self.root: int = data["root_rule_id"]
        self.productive: list[bool] = [False] * len(self.bodies)

    def root_unproductive(self) -> bool:
        users: list[set[int]] = [set() for _ in self.bodies]  # rule -> rules whose body names it
        for rule, body in enumerate(self.bodies):
            for used in self._refs(body):
                users[used].add(rule)
        pending = list(range(len(self.bodies)))
        while pending:  # a rule is looked at again only when one it names turned productive
            rule = pending.pop()
            if not self.productive[rule] and self._derives(self.bodies[rule]):
                self.productive[rule] = True
                pending.extend(users[rule])
        return not self.productive[self.root]

    def _refs(self, expr_id: int) -> set[int]:
        kind, args = self._expr(expr_id)
        if kind == _RULE_REF:
            return {args[0]}
        if kind == _REPEAT:
            return {args[0]}
        if kind in (_SEQUENCE, _CHOICES):
            return set().union(*(self._refs(e) for e in args))
        return set()

    def _expr(self, expr_id: int) -> tuple[int, list[int]]:
        return self.exprs[expr_id]

    def _derives(self, expr_id: int) -> bool:
        """Whether this expression derives some finite text, given the rules known productive."""
        kind, args = self._expr(expr_id)
        if kind in (_BYTE_STRING, _CHAR_CLASS_STAR, _EMPTY):
            return True
        if kind == _CHAR_CLASS:
            return _class_nonempty(args)
        if kind == _RULE_REF:
            return self.productive[args[0]]
        if kind == _SEQUENCE:
            return all(self._derives(e) for e in args)
        if kind == _CHOICES:
            return any(self._derives(e) for e in args)
        if kind == _REPEAT:  # (rule, min, max): zero copies always derive the empty text
            return args[1] == 0 or self.productive[args[0]]
        return True  # tag dispatch and anything newer: assume it can end


def _decode(flat: list[int], start: int) -> tuple[int, list[int]]:
    """One expression of the flat array: its type, its length, then that many ints."""
    kind, length = flat[start], flat[start + 1]
    args = flat[start + 2 : start + 2 + length]
    if len(args) != length:
        raise ValueError("unexpected expression layout")
    return kind, args


def _class_nonempty(args: list[int]) -> bool:
    """A character class [negated, lo1, hi1, lo2, hi2, ...] admits some code point."""
    negated, ranges = bool(args[0]), sorted(zip(args[1::2], args[2::2]))
    if not negated:
        return any(lo <= hi for lo, hi in ranges)
    covered = -1  # the highest code point excluded so far, scanning from 0
    for lo, hi in ranges:
        if lo > covered + 1:
            return True
        covered = max(covered, hi)
    return covered < _MAX_CODEPOINT
