"""Whether a name xgrammar may write under one patternProperties pattern is matched by another.

JSON Schema applies every pattern that matches a name (and the name's `properties` schema, if
any) to its value; xgrammar 0.2.8 writes each pattern as its own alternative, a name and the
one schema beside it, so a name two patterns match was checked against one of them only.
schema_support.py refuses such a schema when the schemas differ; this module decides whether
the patterns can meet: some name matches the first in full (xgrammar writes a key's pattern as
a full match) and the second somewhere (JSON Schema's patterns are not anchored). Both are read
by Python's regex parser into automata whose product is searched for an accepted name; a
construct it does not model (a backreference, a lookaround, a flag) counts as "they may meet".
"""

from __future__ import annotations

import re
import re._constants as sre_c
import re._parser as sre_parse

from kvserve.structured.json_patterns import MAX_CODE_POINT, complement
from kvserve.structured.regex_flavour import ECMA_SPACES, for_xgrammar

_TOP = MAX_CODE_POINT
_ALL = ((0, _TOP),)
_MAX_STATES = 4000  # automaton states; past this the answer is "they may meet"
_MAX_VISITS = 4000  # product states searched (about 0.5 s at worst)
_DIGIT = ((0x30, 0x39),)
_WORD = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
# ECMA-262's \d, \w and \s, and their complements
_CATEGORIES = {
    sre_c.CATEGORY_DIGIT: (_DIGIT, False), sre_c.CATEGORY_NOT_DIGIT: (_DIGIT, True),
    sre_c.CATEGORY_WORD: (_WORD, False), sre_c.CATEGORY_NOT_WORD: (_WORD, True),
    sre_c.CATEGORY_SPACE: (ECMA_SPACES, False), sre_c.CATEGORY_NOT_SPACE: (ECMA_SPACES, True),
}  # fmt: skip


class _Unknown(Exception):
    """A construct the automaton does not model."""


def may_overlap(full: str, search: str) -> bool:
    """Whether some name matches `full` in full and `search` somewhere (True when unsure)."""
    try:
        a, b = _Nfa(), _Nfa()
        a_start, a_end = a.build(_parse(full))
        b_start, b_end = b.searching(_parse(search))
        return _meet(a, a_start, a_end, b, b_start, b_end)
    except (_Unknown, re.error, RecursionError, OverflowError, ValueError):
        return True


def _parse(pattern: str):
    return sre_parse.parse(for_xgrammar(pattern, python=False))


class _Nfa:
    """Thompson automaton: edges are (label, target), a label None (empty), "^" / "$" (an
    anchor: crossed only at the name's start / end) or a tuple of (low, high) code point ranges."""

    def __init__(self) -> None:
        self.edges: list[list[tuple]] = []

    def state(self) -> int:
        if len(self.edges) >= _MAX_STATES:
            raise _Unknown("too many states")
        self.edges.append([])
        return len(self.edges) - 1

    def searching(self, items) -> tuple[int, int]:
        """Any text, the pattern, any text."""
        start, end = self.state(), self.state()
        p_start, p_end = self.build(items, anchors=True)
        self.edges[start] += [(_ALL, start), (None, p_start)]
        self.edges[p_end].append((None, end))
        self.edges[end].append((_ALL, end))
        return start, end

    def build(self, items, anchors: bool = False) -> tuple[int, int]:
        start = cur = self.state()
        for op, arg in items:
            s, e = self._item(op, arg, anchors)
            self.edges[cur].append((None, s))
            cur = e
        return start, cur

    def _item(self, op, arg, anchors: bool) -> tuple[int, int]:
        if op in (sre_c.LITERAL, sre_c.NOT_LITERAL, sre_c.ANY, sre_c.IN):
            s, e = self.state(), self.state()
            self.edges[s].append((_chars(op, arg), e))
            return s, e
        if op is sre_c.AT:
            s, e = self.state(), self.state()
            if arg in (sre_c.AT_BEGINNING, sre_c.AT_BEGINNING_STRING):
                label = "^" if anchors else None
            elif arg in (sre_c.AT_END, sre_c.AT_END_STRING):
                label = "$" if anchors else None
            else:
                raise _Unknown(arg)
            self.edges[s].append((label, e))
            return s, e
        if op is sre_c.BRANCH:
            s, e = self.state(), self.state()
            for alt in arg[1]:
                a, b = self.build(alt, anchors)
                self.edges[s].append((None, a))
                self.edges[b].append((None, e))
            return s, e
        if op is sre_c.SUBPATTERN:
            if arg[1] or arg[2]:  # flags (?i) and the like
                raise _Unknown("flags")
            return self.build(arg[3], anchors)
        if op in (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT, getattr(sre_c, "POSSESSIVE_REPEAT", None)):
            return self._repeat(*arg, anchors)
        raise _Unknown(op)

    def _repeat(self, low: int, high, items, anchors: bool) -> tuple[int, int]:
        start = cur = self.state()
        for _ in range(low):
            s, e = self.build(items, anchors)
            self.edges[cur].append((None, s))
            cur = e
        if high is sre_c.MAXREPEAT:
            s, e = self.build(items, anchors)
            self.edges[cur].append((None, s))
            self.edges[e].append((None, cur))
            return start, cur
        end = self.state()
        for _ in range(high - low):
            self.edges[cur].append((None, end))
            s, e = self.build(items, anchors)
            self.edges[cur].append((None, s))
            cur = e
        self.edges[cur].append((None, end))
        return start, end

    def closure(self, states, at_start: bool, at_end: bool) -> frozenset[int]:
        seen, todo = set(states), list(states)
        while todo:
            for label, target in self.edges[todo.pop()]:
                crosses = label is None or (label == "^" and at_start) or (label == "$" and at_end)
                if crosses and target not in seen:
                    seen.add(target)
                    todo.append(target)
        return frozenset(seen)

    def step(self, states, c: int) -> frozenset[int]:
        return frozenset(
            t for s in states for label, t in self.edges[s]
            if isinstance(label, tuple) and any(lo <= c <= hi for lo, hi in label)
        )  # fmt: skip

    def bounds(self, states) -> set[int]:
        return {b for s in states for label, _ in self.edges[s] if isinstance(label, tuple)
                for lo, hi in label for b in (lo, hi + 1)}  # fmt: skip


def _meet(a: _Nfa, a0: int, a_end: int, b: _Nfa, b0: int, b_end: int) -> bool:
    """Whether a name takes both automata from their start to their end (breadth first over
    pairs of state sets, one character per elementary interval of the ranges leaving them)."""
    first = (a.closure({a0}, True, False), b.closure({b0}, True, False), True)
    seen, todo = {first}, [first]
    while todo:
        sa, sb, at_start = todo.pop()
        if a_end in a.closure(sa, at_start, True) and b_end in b.closure(sb, at_start, True):
            return True
        for c in sorted((a.bounds(sa) | b.bounds(sb) | {0}) - {_TOP + 1}):
            na, nb = a.step(sa, c), b.step(sb, c)
            if na and nb:
                pair = (a.closure(na, False, False), b.closure(nb, False, False), False)
                if pair not in seen:
                    if len(seen) >= _MAX_VISITS:
                        raise _Unknown("too many states")
                    seen.add(pair)
                    todo.append(pair)
    return False


def _chars(op, arg) -> tuple[tuple[int, int], ...]:
    """The code points one character item takes, as sorted ranges."""
    if op is sre_c.LITERAL:
        return ((arg, arg),)
    if op is sre_c.NOT_LITERAL:
        return _complement(((arg, arg),))
    if op is sre_c.ANY:
        return _complement(((0x0A, 0x0A),))
    ranges: list[tuple[int, int]] = []
    negate = False
    for kind, value in arg:
        if kind is sre_c.NEGATE:
            negate = True
        elif kind is sre_c.LITERAL:
            ranges.append((value, value))
        elif kind is sre_c.RANGE:
            ranges.append(value)
        elif kind is sre_c.CATEGORY:
            ranges.extend(_category(value))
        else:
            raise _Unknown(kind)
    merged = _complement(_complement(tuple(ranges)))
    return _complement(merged) if negate else merged


def _category(cat) -> tuple[tuple[int, int], ...]:
    if cat not in _CATEGORIES:
        raise _Unknown(cat)
    ranges, negated = _CATEGORIES[cat]
    return _complement(ranges) if negated else ranges


def _complement(ranges) -> tuple[tuple[int, int], ...]:
    return tuple(complement(ranges))
