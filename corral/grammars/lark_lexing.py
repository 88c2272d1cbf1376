r"""Whether a Lark grammar means the same under a greedy lexer as under a character-level CFG.

xgrammar reads a grammar as the character-level CFG it is; llguidance lexes its terminals greedily (a terminal
goes on while the next character can continue it), so under it `x: "a"*` before `"ab"` refuses "aaab", and
`/[a-z]+/` before `"b"` refuses "aab". Where neither can happen, the two accept exactly the same texts, and
llguidance fills the masks of wide grammars several times faster (a CSV grammar:
docs/benchmarks.md#mask-cost-per-constraint-kind-corral-bench-kinds). `greedy_lexing_exact` proves that from the
grammar alone, conservatively:

1. No terminal matches the empty text.
2. Where several terminals may come next (at the start, after any terminal), their first characters differ,
   or both are strings neither of which starts the other: what is read decides which terminal it is before
   either is complete.
3. No character that may continue a terminal (any character of a pattern after its first, none for a
   string) may start a terminal that can follow it, so a greedy terminal ends exactly where the CFG's does.
   `%ignore`d terminals may come anywhere, so they count as following, and followed by, every terminal.

Under 2 and 3 each text of the grammar splits into terminals one way, and the greedy lexer finds that split;
it accepts nothing else, as it only ever continues a parse of the grammar. Anything the check cannot read (a
flag, a look-around, a grammar Lark's own loader refuses, such as llguidance's extensions) is not proved, and
`auto` keeps xgrammar first; so is a pattern with `.`, `\d`, `\w` or `\s`, where the engines' dialects differ
(docs/benchmarks.md). A negated class counts as every character.
"""

from __future__ import annotations

import functools
import re
import re._constants as sre
import re._parser as sre_parse
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from lark.exceptions import LarkError
from lark.grammar import Rule
from lark.lexer import PatternStr, TerminalDef
from lark.load_grammar import load_grammar
from lark.tree import Tree

from corral.grammars.limits import lark_terminals

_load_grammar = cast(Callable[..., tuple[Any, Any]], load_grammar)  # lark's loader carries no annotations
EVERY = frozenset({-1})  # stands for every character: intersects everything
# A class of this many characters or more, repeated up to WIDE_REPEAT times or more, makes a grammar "wide":
# `[a-z0-9 ]{1,12}` is, `[0-9]{1,3}` is not (xgrammar's masks are the cheaper there: the `lark id` case of
# docs/benchmarks.md#mask-cost-per-constraint-kind-corral-bench-kinds).
WIDE_CLASS = 16
WIDE_REPEAT = 4
_END = "$END"
# Lark's compile writes each rule out as plain sequences: `x?` and `(a|b)` multiply a rule's alternatives, and
# `x ~ a..b` adds one per count, so 18 optional items took 11 s and `("a" ~ 0..8) ~ 0..8` over a minute, on
# the request's path. Past this many alternatives (counted on the parsed grammar first, which is cheap) the
# grammar is left unproven; the grammars the check is for have a few dozen. Lark's loader also copies a terminal
# into every terminal that names it (a chain of terminals each naming the next twice: 20 links, 34 s in the
# loader itself), so a grammar whose terminals name terminals is left unproven before Lark reads it (requests
# refuse the exponential ones outright, corral/grammars/limits.py).
MAX_ALTERNATIVES = 2_000
MAX_SOURCE = 20_000


class Unproven(Exception):
    """The check cannot read this pattern or grammar."""


def _union(sets: Iterable[frozenset[int]]) -> frozenset[int]:
    out: set[int] = set()
    for chars in sets:
        if -1 in chars:
            return EVERY
        out |= chars
    return frozenset(out)


def _meets(a: frozenset[int], b: frozenset[int]) -> bool:
    return bool(a and b) and (-1 in a or -1 in b or not a.isdisjoint(b))


def _class_chars(items: Any) -> frozenset[int]:
    chars: set[int] = set()
    for op, arg in items:
        if op is sre.LITERAL:
            chars.add(arg)
        elif op is sre.RANGE:
            low, high = arg
            if high - low > 4096:
                return EVERY
            chars.update(range(low, high + 1))
        elif op is sre.NEGATE:
            return EVERY
        else:  # \d, \w, \s: ASCII under xgrammar, Unicode under llguidance; this grammar stays where it was
            raise Unproven(f"class item {op}")
    return frozenset(chars)


@dataclass(frozen=True)
class _Shape:
    """What the check reads of a pattern: its first characters, every character, whether it matches the empty
    text, and whether it repeats a class of WIDE_CLASS characters or more."""

    first: frozenset[int]
    chars: frozenset[int]
    nullable: bool
    wide: bool


def _shape(items: Any) -> _Shape:
    """A sequence of sre items."""
    firsts: list[frozenset[int]] = []
    chars: list[frozenset[int]] = []
    nullable, wide = True, False
    for op, arg in items:
        part = _item(op, arg)
        if nullable:
            firsts.append(part.first)
        nullable = nullable and part.nullable
        chars.append(part.chars)
        wide = wide or part.wide
    return _Shape(_union(firsts), _union(chars), nullable, wide)


def _item(op: Any, arg: Any) -> _Shape:
    if op is sre.LITERAL:
        return _Shape(frozenset({arg}), frozenset({arg}), False, False)
    if op is sre.IN:
        chars = _class_chars(arg)
        return _Shape(chars, chars, False, False)
    if op is sre.NOT_LITERAL:
        return _Shape(EVERY, EVERY, False, False)
    if op is sre.ANY:  # a newline or not: the two engines differ
        raise Unproven("`.`")
    if op is sre.SUBPATTERN:
        _, add_flags, del_flags, sub = arg
        if add_flags or del_flags:
            raise Unproven("inline flags")
        return _shape(sub)
    if op is sre.BRANCH:
        parts = [_shape(sub) for sub in arg[1]]
        return _Shape(
            _union(p.first for p in parts), _union(p.chars for p in parts), any(p.nullable for p in parts),
            any(p.wide for p in parts),
        )
    if op in (sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT):
        low, high, sub = arg
        body = _shape(sub)
        repeats = high == sre.MAXREPEAT or high >= WIDE_REPEAT
        wide = body.wide or (repeats and (-1 in body.chars or len(body.chars) >= WIDE_CLASS))
        return _Shape(body.first, body.chars, low == 0 or body.nullable, wide)
    raise Unproven(f"pattern item {op}")


@dataclass(frozen=True)
class _Terminal:
    first: frozenset[int]
    continues: frozenset[int]  # characters that may extend a complete match
    wide: bool
    text: str | None = None  # a string terminal's text

    def apart(self, other: _Terminal) -> bool:
        """The two may come at the same place: their first characters differ, or both are strings neither of
        which starts the other (the lexer reads on until they differ, and neither is complete before)."""
        if not _meets(self.first, other.first):
            return True
        if self.text is None or other.text is None:
            return False
        return not (self.text.startswith(other.text) or other.text.startswith(self.text))


def _terminal(definition: TerminalDef) -> _Terminal:
    pattern = definition.pattern
    if pattern.flags:
        raise Unproven(f"flags on {definition.name}")
    if isinstance(pattern, PatternStr):
        if not pattern.value:
            raise Unproven(f"{definition.name} is empty")
        first = frozenset({ord(pattern.value[0])})
        return _Terminal(first, frozenset(), False, pattern.value)  # a string, once complete, never goes on
    try:
        parsed = sre_parse.parse(pattern.to_regexp())
    except re.error as exc:
        raise Unproven(f"{definition.name}: {exc}") from exc
    shape = _shape(parsed)
    if shape.nullable:
        raise Unproven(f"{definition.name} matches the empty text")
    return _Terminal(shape.first, shape.chars, shape.wide)


def _follow_sets(rules: list[Rule], start: str) -> tuple[set[str], dict[str, set[str]]]:
    """(terminals that may come first, terminals that may follow each terminal; _END for the end)."""
    nullable: set[str] = set()
    first: dict[str, set[str]] = {}

    def first_of(symbols: Sequence[Any]) -> tuple[set[str], bool]:
        out: set[str] = set()
        for symbol in symbols:
            if symbol.is_term:
                out.add(symbol.name)
                return out, False
            out |= first.get(symbol.name, set())
            if symbol.name not in nullable:
                return out, False
        return out, True

    changed = True
    while changed:
        changed = False
        for rule in rules:
            found, empty = first_of(rule.expansion)
            mine = first.setdefault(rule.origin.name, set())
            if not found <= mine:
                mine |= found
                changed = True
            if empty and rule.origin.name not in nullable:
                nullable.add(rule.origin.name)
                changed = True
    follow: dict[str, set[str]] = {start: {_END}}
    changed = True
    while changed:
        changed = False
        for rule in rules:
            for index, symbol in enumerate(rule.expansion):
                after, empty = first_of(rule.expansion[index + 1 :])
                if empty:
                    after = after | follow.get(rule.origin.name, set())
                mine = follow.setdefault(symbol.name, set())
                if not after <= mine:
                    mine |= after
                    changed = True
    return first.get(start, set()), follow


def greedy_lexing_exact(source: str, start: str = "start") -> bool:
    """Whether a greedy lexer provably accepts exactly the texts of the Lark grammar `source` (the module
    docstring's rules). False where anything is unproven."""
    return _analyse(source, start) in ("narrow", "wide")


def wide_and_exact(source: str, start: str = "start") -> bool:
    """`greedy_lexing_exact`, and some terminal repeats a class of WIDE_CLASS characters or more: where masks
    cost xgrammar the most (narrow grammars cost both engines little)."""
    return _analyse(source, start) == "wide"


def _alternatives(node: Any) -> int:
    """An upper bound (capped past MAX_ALTERNATIVES) on the plain sequences Lark's compile writes for a parsed
    rule body: sums over alternatives, products over a sequence's items."""
    if not isinstance(node, Tree):
        return 1
    counts = [_alternatives(c) for c in node.children if isinstance(c, Tree)]
    total = 1
    if node.data == "expansions":
        total = sum(counts)
    elif node.data == "expr":
        ops = [str(c) for c in node.children if not isinstance(c, Tree)]
        inner = counts[0] if counts else 1
        if ops[:1] == ["~"]:
            low, high = int(ops[-2]), int(ops[-1])
            if high > 64 or inner ** min(high, 8) > MAX_ALTERNATIVES:
                return MAX_ALTERNATIVES + 1
            total = sum(inner**k for k in range(low, high + 1))
        else:  # `?` and `*` leave the item out or not; `+` keeps it
            total = inner + (ops[:1] != ["+"])
    elif node.data == "maybe":
        total = counts[0] + 1 if counts else 1
    else:  # a sequence, or anything holding one
        for count in counts:
            total = min(total * count, MAX_ALTERNATIVES + 1)
    return min(total, MAX_ALTERNATIVES + 1)


@functools.lru_cache(maxsize=256)
def _analyse(source: str, start: str) -> str:
    """"wide", "narrow" or "unproven"; once per grammar (both public questions and every request ask it)."""
    if len(source) > MAX_SOURCE or any(refs for _, refs in lark_terminals(source).values()):
        return "unproven"
    try:
        grammar, _ = _load_grammar(source, "<corral>", [], False)
        if sum(_alternatives(rule[2]) for rule in grammar.rule_defs) > MAX_ALTERNATIVES:
            return "unproven"
        definitions, rules, ignored = grammar.compile([start], set())
        terminals = {d.name: _terminal(d) for d in definitions}
    except (LarkError, Unproven, re.error, RecursionError, KeyError, ValueError):
        return "unproven"
    initial, follow = _follow_sets(rules, start)
    names = set(terminals)
    ignored_set = set(ignored)
    places = [initial | ignored_set]  # the terminals that may come at one place in a text
    for name in names:
        after = names if name in ignored_set else (follow.get(name, set()) - {_END}) | ignored_set
        if any(_meets(terminals[name].continues, terminals[other].first) for other in after):
            return "unproven"  # rule 3
        places.append(set(after))
    for place in places:
        listed = sorted(place)
        for i, one in enumerate(listed):
            if not all(terminals[one].apart(terminals[other]) for other in listed[i + 1 :]):
                return "unproven"  # rule 2
    return "wide" if any(t.wide for t in terminals.values()) else "narrow"
