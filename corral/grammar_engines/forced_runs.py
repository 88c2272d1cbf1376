"""How long a run of text an xgrammar grammar can force, read from its serialised expression table.

xgrammar's `find_jump_forward_string` builds the whole forced string in one uninterruptible call, so a grammar
that forces a huge run holds the engine thread: 30 rules each naming the next twice (`a0 ::= a1 a1` ...
`a30 ::= "x"`) force 2^30 characters, a JSON Schema whose definitions do the same through `$ref` and `const`
too, and counted repetitions nest the same way (`((x{1000}){1000}){1000}`).

The text forced from a point is the longest common prefix of every way to finish from there. That way finishes
the rest of each sequence on the parser's stack, innermost first, and the run only reaches an outer sequence
once the inner rest is forced whole. So a run is at most (stack depth) x (the longest common prefix of any
sequence's suffix), and the stack only grows with text the model wrote. `forced_run_bound` computes that
second factor, from above, for every expression:

- `shortest`: the length of its shortest text (Knuth's generalisation of Dijkstra: a sequence is ready when
  its parts are, a choice with its first ready part, a repeat as `min` times its rule).
- `prefix`: a string its common prefix starts with (`open`: or runs on past it, unknown). A choice meets its
  parts' prefixes; a sequence keeps its first part's when that is shorter than the part's shortest text (the
  texts differ inside it), else follows the shortest text into the next part. Rules go in dependency order
  (Tarjan's groups); rules that name each other start unknown and are recomputed until nothing changes (at most
  MAX_PASSES; every pass is a sound bound).
- A pattern (xgrammar keeps one as a rule body, matched by an automaton) counts as its shortest match in bytes
  unknown here (WILD), and a run starting inside it as at most the longest shortest way on from any point of it.
"""

from __future__ import annotations

import heapq
import json
import re
import re._constants as re_constants
import re._parser as re_parser
import sys
from collections.abc import Sequence
from functools import reduce
from typing import Any

# Expression types in xgrammar's serialisation (`grammar_expr_data`: type, payload length, payload).
BYTE_STRING, CHARACTER_CLASS, CHARACTER_CLASS_STAR, EMPTY_STRING = 0, 1, 2, 3
RULE_REF, SEQUENCE, CHOICES, TAG_DISPATCH, REPEAT = 4, 5, 6, 7, 8
REGEX, SUBSTRING = 12, 13  # a rule body each: a pattern's automaton; any run of given chunks (empty included)
_JS_NAMED_GROUP = re.compile(r"\(\?<(?![=!])")  # `(?<name>` in JSON Schema's dialect, `(?P<name>` in Python's
WILD = 0xFF  # a byte of a regex's shortest text, unknown here: never part of UTF-8, matches any byte
UNFINISHED = sys.maxsize  # the shortest text of an expression that cannot finish
MAX_PASSES = 8

Prefix = tuple[bytes, bool]  # (known start of the common prefix, whether it may run on past it)
UNKNOWN: Prefix = (b"", True)
NOTHING: Prefix = (b"", False)


def forced_run_bound(serialised: str | dict[str, Any], cap: int) -> int:
    """An upper bound on the text one stack frame of the grammar can force, saturating at `cap + 1`.
    `serialised` is xgrammar's `Grammar.serialize_json()` or its parsed form."""
    table = json.loads(serialised) if isinstance(serialised, str) else serialised
    try:
        grammar = _Expressions(table)
    except _Unreadable:
        return cap + 1
    return _Prefixes(grammar, _shortest_texts(grammar), cap + 1).bound()


class _Unreadable(Exception):
    """An expression this module cannot bound (a token set, an unknown type, a pattern `re` cannot read)."""


class _Expressions:
    def __init__(self, table: dict[str, Any]) -> None:
        data: Sequence[int] = table["grammar_expr_data"]
        starts: Sequence[int] = table["grammar_expr_indptr"]
        ends = [*starts[1:], len(data)]
        self.kinds = [data[start] for start in starts]
        self.payloads = [data[start + 2 : end] for start, end in zip(starts, ends, strict=True)]
        self.bodies = [int(rule[1]) for rule in table["rules"]]
        self.pattern_widths = {
            expr: _pattern_widths(self.payloads[expr][1:]) for expr, kind in enumerate(self.kinds) if kind == REGEX
        }
        if unknown := set(self.kinds) - {*range(BYTE_STRING, REPEAT + 1), REGEX, SUBSTRING}:
            raise _Unreadable(f"expression types {sorted(unknown)}")


def _pattern_widths(pattern: Sequence[int]) -> tuple[int, int]:
    """A pattern's shortest match, and a bound on the shortest way to finish it from anywhere inside it,
    by Python's own regex parser (exact for what it reads; what it cannot read is not bounded)."""
    try:
        parsed = re_parser.parse(_JS_NAMED_GROUP.sub("(?P<", bytes(pattern).decode()))
        return int(parsed.getwidth()[0]), _longest_rest(parsed)
    except (re.error, UnicodeDecodeError, OverflowError, RecursionError) as exc:
        raise _Unreadable(str(exc)) from exc


def _longest_rest(items: Any) -> int:
    """Each item's bound summed, the widest branch of an alternation, a repeat's body at least once (a run
    may start inside any repetition); look-arounds and anchors write nothing."""
    total = 0
    for op, value in items:
        if op in (re_constants.LITERAL, re_constants.NOT_LITERAL, re_constants.ANY, re_constants.IN):
            total += 1
        elif op == re_constants.BRANCH:
            total += max(_longest_rest(branch) for branch in value[1])
        elif op == re_constants.SUBPATTERN:
            total += _longest_rest(value[-1])
        elif op == re_constants.ATOMIC_GROUP:
            total += _longest_rest(value)
        elif op in (re_constants.MAX_REPEAT, re_constants.MIN_REPEAT, re_constants.POSSESSIVE_REPEAT):
            total += max(int(value[0]), 1) * _longest_rest(value[2])
        elif op not in (re_constants.AT, re_constants.ASSERT, re_constants.ASSERT_NOT):
            raise re.error(f"cannot bound {op}")
    return total


def _shortest_texts(grammar: _Expressions) -> list[int]:
    """Shortest text length per expression then per rule (node E + rule id); UNFINISHED where none ends."""
    count = len(grammar.kinds)
    lengths = [UNFINISHED] * (count + len(grammar.bodies))
    parents: list[list[int]] = [[] for _ in lengths]
    waiting: dict[int, set[int]] = {}  # a sequence's parts not yet final
    heap: list[tuple[int, int]] = []
    for expr, (kind, payload) in enumerate(zip(grammar.kinds, grammar.payloads, strict=True)):
        if kind == BYTE_STRING:
            heap.append((len(payload), expr))
        elif kind == CHARACTER_CLASS:
            heap.append((1, expr))
        elif kind in (CHARACTER_CLASS_STAR, EMPTY_STRING, TAG_DISPATCH, SUBSTRING):
            heap.append((0, expr))  # a tag dispatch may write free text; its tags' rules count on their own
        elif kind == REGEX:
            heap.append((grammar.pattern_widths[expr][0], expr))
        elif kind in (RULE_REF, REPEAT):
            parents[count + payload[0]].append(expr)
        else:  # a sequence or a choice (_Expressions refused any other type)
            for part in set(payload):
                parents[part].append(expr)
            if kind == SEQUENCE:
                waiting[expr] = set(payload)
                if not payload:
                    heap.append((0, expr))
    for rule, body in enumerate(grammar.bodies):
        parents[body].append(count + rule)
    heapq.heapify(heap)
    while heap:
        length, node = heapq.heappop(heap)
        if lengths[node] != UNFINISHED:
            continue
        lengths[node] = length
        for parent in parents[node]:
            if lengths[parent] != UNFINISHED:
                continue
            kind = grammar.kinds[parent] if parent < count else CHOICES
            if kind == SEQUENCE:
                waiting[parent].discard(node)
                if not waiting[parent]:  # every part final; a part named twice counts twice
                    heapq.heappush(heap, (sum(lengths[part] for part in grammar.payloads[parent]), parent))
            elif kind == REPEAT:
                heapq.heappush(heap, (grammar.payloads[parent][1] * length, parent))
            else:  # a choice, a rule or a reference to one: its first final part is its shortest
                heapq.heappush(heap, (length, parent))
    return lengths


def _groups(named: list[list[int]]) -> list[list[int]]:
    """Strongly connected groups of rules, each after every group it names (Tarjan's algorithm, iterative)."""
    index, low = [-1] * len(named), [0] * len(named)
    on_stack = [False] * len(named)
    stack: list[int] = []
    groups: list[list[int]] = []
    counter = 0
    for root in range(len(named)):
        if index[root] >= 0:
            continue
        work = [(root, 0)]
        while work:
            node, position = work.pop()
            if position == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on_stack[node] = True
            children = named[node]
            while position < len(children):
                child = children[position]
                position += 1
                if index[child] < 0:
                    work += [(node, position), (child, 0)]
                    break
                if on_stack[child]:
                    low[node] = min(low[node], index[child])
            else:
                if low[node] == index[node]:
                    group: list[int] = []
                    while not group or group[-1] != node:
                        group.append(stack.pop())
                        on_stack[group[-1]] = False
                    groups.append(group)
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
    return groups


def _meet(a: Prefix, b: Prefix) -> Prefix:
    """The prefix of a union: what both starts agree on, or the other's when one may run on past its own."""
    (x, x_open), (y, y_open) = a, b
    common = _agreement(x, y)
    if x_open and common == len(x):
        return b
    if y_open and common == len(y):
        return a
    return (_merge(x[:common], y[:common]), False)


def _agreement(x: bytes, y: bytes) -> int:
    """How many leading bytes of x and y agree, a WILD byte agreeing with any."""
    wild = WILD in x or WILD in y
    for index, (p, q) in enumerate(zip(x, y, strict=False)):
        if p != q and not (wild and WILD in (p, q)):
            return index
    return min(len(x), len(y))


def _merge(x: bytes, y: bytes) -> bytes:
    """Two agreeing strings as one, known bytes over WILD ones."""
    if WILD not in x:
        return x
    return bytes(q if p == WILD else p for p, q in zip(x, y, strict=True))


class _Prefixes:
    def __init__(self, grammar: _Expressions, shortest: list[int], limit: int) -> None:
        self._g = grammar
        self._shortest = shortest
        self._limit = limit
        self._rules: list[Prefix] = [UNKNOWN] * len(grammar.bodies)
        self._longest = 0  # the longest suffix prefix seen while evaluating one rule

    def bound(self) -> int:
        """Rules in dependency order, a group of rules naming each other recomputed until it settles; the
        bound is the longest suffix prefix any rule's settled evaluation saw."""
        named = self._named_rules()
        windows = [0] * len(self._g.bodies)
        for group in _groups(named):
            cyclic = len(group) > 1 or group[0] in named[group[0]]
            for _ in range(MAX_PASSES if cyclic else 1):
                changed = False
                for rule in group:
                    self._longest = 0
                    value = self._expression(self._g.bodies[rule], {})
                    changed |= value != self._rules[rule]
                    self._rules[rule], windows[rule] = value, self._longest
                if not changed:
                    break
        return max(windows, default=0)

    def _named_rules(self) -> list[list[int]]:
        named: list[list[int]] = [[] for _ in self._g.bodies]
        for rule, body in enumerate(self._g.bodies):
            stack = [body]
            while stack:
                expr = stack.pop()
                kind, payload = self._g.kinds[expr], self._g.payloads[expr]
                if kind in (RULE_REF, REPEAT):
                    named[rule].append(payload[0])
                elif kind in (SEQUENCE, CHOICES):
                    stack.extend(payload)
        return named

    def _note(self, value: Prefix) -> Prefix:
        text, is_open = value
        if len(text) >= self._limit:
            value = (text[: self._limit], False)
        self._longest = max(self._longest, self._limit if is_open else len(value[0]))
        return value

    def _expression(self, expr: int, memo: dict[int, Prefix]) -> Prefix:
        if expr in memo:
            return memo[expr]
        kind, payload = self._g.kinds[expr], self._g.payloads[expr]
        value: Prefix
        if kind == BYTE_STRING:
            value = (bytes(payload), False)
        elif kind == CHARACTER_CLASS:
            negated, ranges = payload[0], payload[1:]
            single = not negated and len(ranges) == 2 and ranges[0] == ranges[1]
            value = (chr(ranges[0]).encode() if single else b"", False)
        elif kind in (CHARACTER_CLASS_STAR, EMPTY_STRING, TAG_DISPATCH, SUBSTRING):
            value = NOTHING
        elif kind == REGEX:  # its common prefix lies within its shortest match, whose bytes are unknown here
            shortest, inside = self._g.pattern_widths[expr]
            self._longest = max(self._longest, min(inside, self._limit))
            value = (bytes([WILD]) * min(shortest, self._limit), False)
        elif kind == RULE_REF:
            value = self._rules[payload[0]]
        elif kind == REPEAT:
            value = self._repeat(payload[0], payload[1], payload[2])
        elif kind == CHOICES:
            value = reduce(_meet, (self._expression(part, memo) for part in payload), UNKNOWN)
        else:
            value = self._sequence(payload, memo)
        memo[expr] = value = self._note(value)
        return value

    def _sequence(self, parts: Sequence[int], memo: dict[int, Prefix]) -> Prefix:
        rest: Prefix = NOTHING
        for part in reversed(parts):  # every suffix is a place a stack frame may resume from
            rest = self._note(self._then(self._expression(part, memo), self._shortest[part], rest))
        return rest

    def _then(self, first: Prefix, shortest: int, rest: Prefix) -> Prefix:
        """The prefix of `first` followed by `rest`: the common prefix is a prefix of the shortest text's."""
        text = first[0]
        if shortest == UNFINISHED:
            return UNKNOWN
        if len(text) < shortest:
            return first  # the texts part before the shortest one ends (or `first` is unknown there)
        return (text[:shortest] + rest[0][: self._limit], rest[1])

    def _repeat(self, rule: int, low: int, high: int) -> Prefix:
        count = len(self._g.kinds)
        unit = self._rules[rule]
        shortest = self._shortest[count + rule]
        if low == 0 or shortest == 0:
            return NOTHING  # the empty text is among its texts
        if shortest == UNFINISHED:
            return UNKNOWN
        if len(unit[0]) < shortest:
            return unit  # the rule's texts part inside its first repetition
        times = min(low, self._limit // shortest + 1)
        whole = unit[0][:shortest] * (times - 1)
        if high == low:
            return (whole + unit[0], unit[1])
        return (whole + unit[0][:shortest], False)  # more repetitions may follow, or not
