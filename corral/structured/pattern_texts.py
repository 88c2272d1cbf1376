"""A short text that matches a JSON Schema `pattern`, for the closing search (corral/structured/closing.py).

Where a string may not end until its pattern has matched (`"pattern": "f-[0-9]+"`), the grammar's mask allows
almost every token and only withholds `"`, so the mask gives the search no direction: it wrote `1 1 1 …` until
its budget ran out and the answer ended `stall`. The schema says what is missing; this writes the shortest
text its regex accepts (one repetition where one is required, the shortest alternative, the first character of
a class) from Python's own regex parser, and keeps it only if `re.search` agrees.
"""

from __future__ import annotations

import functools
import importlib
import json
import re
from typing import Any

from corral.grammars.json_walk import objects_in
from corral.grammars.spec import GrammarSpec

# CPython's own regex parser: the dialect the final check uses (imported by name: typeshed no longer lists it).
sre: Any = importlib.import_module("re._parser")

MAX_EXAMPLE = 48  # characters: a longer example would not close an answer cheaply anyway
MAX_PATTERNS = 32  # per spec: the search tries each one where a string will not end
_PROBES = "a0A_-. :/@"  # a character for a negated class or `.`, tried in this order


def _example(parsed: Any) -> str | None:
    out: list[str] = []
    for op, arg in parsed:
        if op is sre.LITERAL:
            out.append(chr(arg))
        elif op is sre.NOT_LITERAL:
            out.append(next(c for c in _PROBES if ord(c) != arg))
        elif op is sre.ANY:
            out.append("a")
        elif op is sre.IN:
            char = _class_member(arg)
            if char is None:
                return None
            out.append(char)
        elif op in (sre.MAX_REPEAT, sre.MIN_REPEAT):
            low, _high, body = arg
            piece = _example(body)
            if piece is None or low * len(piece) > MAX_EXAMPLE:
                return None
            out.append(piece * low)
        elif op is sre.SUBPATTERN:
            piece = _example(arg[-1])
            if piece is None:
                return None
            out.append(piece)
        elif op is sre.BRANCH:
            options = [p for p in (_example(branch) for branch in arg[1]) if p is not None]
            if not options:
                return None
            out.append(min(options, key=len))
        elif op in (sre.AT, sre.ASSERT, sre.ASSERT_NOT):
            continue  # anchors and lookarounds write nothing (re.search checks the result)
        else:
            return None
    return "".join(out)


def _class_member(items: list[tuple[Any, Any]]) -> str | None:
    if items and items[0][0] is sre.NEGATE:
        return None  # the final check would do, but a negated class rarely is what a string still needs
    for op, arg in items:
        if op is sre.LITERAL:
            return chr(arg)
        if op is sre.RANGE:
            return chr(arg[0])
        if op is sre.CATEGORY:
            return {sre.CATEGORY_DIGIT: "0", sre.CATEGORY_WORD: "a", sre.CATEGORY_SPACE: " "}.get(arg, "a")
    return None


def pattern_example(pattern: str) -> str | None:
    """The shortest text the regex is found in, as this reads it; None where it cannot say."""
    try:
        example = _example(sre.parse(pattern))
        if example is None or len(example) > MAX_EXAMPLE or re.search(pattern, example) is None:
            return None
    except (re.error, RecursionError, OverflowError, ValueError, TypeError, StopIteration):
        return None
    return example


@functools.lru_cache(maxsize=512)
def pattern_examples(spec: GrammarSpec) -> tuple[str, ...]:
    """For every `pattern` in the spec's schemas: its example as it sits inside a JSON string (escaped)."""
    if not spec.embeds_schema or "pattern" not in spec.source:
        return ()
    found: dict[str, None] = {}
    for node in objects_in(json.loads(spec.source)):
        pattern = node.get("pattern")
        if isinstance(pattern, str) and len(found) < MAX_PATTERNS:
            example = pattern_example(pattern)
            if example:
                found[json.dumps(example, ensure_ascii=False)[1:-1]] = None
    return tuple(found)
