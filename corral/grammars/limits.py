"""Size limits on a caller's constraint, checked before any work that scales with it.

Every walk here is iterative and stops as soon as a limit is passed, so measuring a hostile input costs
at most the limit, never the input. Once a schema is known to be within `max_schema_depth`, the recursive
code after it (jsonschema's meta-schema check, `json.dumps`, the engines' compilers) stays far from
Python's recursion limit and from the native stack.

Defaults accept every schema of JSONSchemaBench (8,499 schemas; the largest figures are in
docs/reliability.md) with room to spare.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from corral.grammars.validation import InvalidConstraint


@dataclass(frozen=True)
class InputLimits:
    """What one request's constraint may hold. Each field is a `corral serve` flag of the same name."""

    max_schema_depth: int = 128  # JSON nesting levels of one schema document
    max_schema_nodes: int = 100_000  # JSON values (objects, arrays, scalars) in one schema document
    max_schema_refs: int = 5_000  # `$ref` keywords in one schema document
    max_regex_length: int = 10_000  # characters
    max_grammar_length: int = 100_000  # characters (EBNF/GBNF or Lark source)
    max_choices: int = 10_000  # options of one `choice`
    max_tools: int = 128  # functions in `tools` (OpenAI's own limit)


DEFAULT_LIMITS = InputLimits()


class LimitExceeded(InvalidConstraint):
    """A constraint is over one of the limits; `code` names which (e.g. `schema_too_deep`)."""

    def __init__(self, message: str, *, param: str, code: str, where: str | None = None) -> None:
        super().__init__(message, param=param, where=where, code=code)


def _children(node: Any) -> Iterator[Any]:
    if isinstance(node, dict):
        return iter(node.values())
    if isinstance(node, list):
        return iter(node)
    return iter(())


def check_schema_limits(schema: Any, limits: InputLimits, *, param: str) -> None:
    """Nesting depth, node count and `$ref` count of one schema document, in one walk without recursion
    that stops at the first limit passed. Every value on the stack is a node still to count, so a node with
    a million children is refused before they are pushed."""
    nodes = refs = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        nodes += 1
        if not isinstance(node, (dict, list)):
            continue
        if depth > limits.max_schema_depth:
            raise LimitExceeded(
                f"{param} nests deeper than {limits.max_schema_depth} levels (limit --max-schema-depth)",
                param=param,
                code="schema_too_deep",
            )
        if nodes + len(stack) + len(node) > limits.max_schema_nodes:
            raise LimitExceeded(
                f"{param} has more than {limits.max_schema_nodes} JSON values (limit --max-schema-nodes)",
                param=param,
                code="schema_too_large",
            )
        if isinstance(node, dict) and isinstance(node.get("$ref"), str):
            refs += 1
            if refs > limits.max_schema_refs:
                raise LimitExceeded(
                    f"{param} has more than {limits.max_schema_refs} $refs (limit --max-schema-refs)",
                    param=param,
                    code="too_many_schema_refs",
                )
        stack.extend((child, depth + 1) for child in _children(node))


def check_source_length(text: str, limit: int, *, what: str, flag: str, param: str) -> None:
    if len(text) > limit:
        raise LimitExceeded(
            f"{param} is {len(text)} characters; the {what} limit is {limit} (--{flag})",
            param=param,
            code=f"{what.replace(' ', '_')}_too_long",
        )


def check_count(count: int, limit: int, *, what: str, flag: str, param: str) -> None:
    if count > limit:
        raise LimitExceeded(
            f"{param} has {count} {what}; at most {limit} (--{flag})", param=param, code=f"too_many_{what}"
        )


# A Lark definition's head (`NAME:`, `?rule:`, `NAME.2:`, `_t{x}:`), its strings and patterns, and upper-case
# names (terminals) in what is left of its body.
_LARK_DEFINITION = re.compile(r"^\s*[?!]?(?P<name>[A-Za-z_][A-Za-z_0-9]*)(?:\.-?\d+)?(?:\{[^}]*\})?\s*:")
_LARK_LITERALS = re.compile(r'"(?:[^"\\\n]|\\.)*"i?|/(?:[^/\\\n]|\\.)+/[imslux]*')
_LARK_UPPER_NAME = re.compile(r"\b_?[A-Z][A-Z_0-9]*\b")
_IMPORTED_TERMINAL = 64  # characters assumed for a terminal named but not defined here (`%import common.WORD`)


def lark_terminals(source: str) -> dict[str, tuple[int, list[str]]]:
    """Each terminal a Lark grammar defines: (characters of its strings and patterns, the terminals its body
    names, once per mention), read line by line (continuation lines included) without parsing the grammar."""
    found: dict[str, tuple[int, list[str]]] = {}
    current: str | None = None
    for line in source.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("//"):
            continue
        head = _LARK_DEFINITION.match(line)
        if head:
            name = head.group("name")
            current = name if name.lstrip("_").isupper() else None
            body = line[head.end() :]
        elif stripped.startswith("%"):
            current = None
            continue
        else:
            body = line
        if current is None:
            continue
        literal = sum(len(m.group()) for m in _LARK_LITERALS.finditer(body))
        names = _LARK_UPPER_NAME.findall(_LARK_LITERALS.sub(" ", body))
        chars, refs = found.get(current, (0, []))
        found[current] = (chars + literal, refs + names)
    return found


def check_lark_terminals(source: str, limit: int, *, param: str) -> None:
    """Lark writes a terminal named inside another out in full, so a chain of terminals each naming the next
    twice grows as 2^links: 30 links compile to a grammar whose masks never return. Every terminal's written-out
    size must stay within `limit` characters, and none may name itself."""
    terminals = lark_terminals(source)
    sizes: dict[str, int] = {}
    for root in terminals:
        stack: list[tuple[str, bool]] = [(root, False)]
        open_names: set[str] = set()
        while stack:
            name, done = stack.pop()
            if name in sizes:
                continue
            chars, refs = terminals.get(name, (_IMPORTED_TERMINAL, []))
            if done:
                open_names.discard(name)
                sizes[name] = min(limit + 1, chars + sum(sizes[r] for r in refs))
                continue
            if name in open_names:
                raise LimitExceeded(
                    f"{param}: the Lark terminal {name} names itself (a terminal cannot be recursive: make it a "
                    f"rule, with a lower-case name)",
                    param=param,
                    code="grammar_terminal_recursive",
                )
            open_names.add(name)
            stack.append((name, True))
            stack.extend((ref, False) for ref in refs if ref not in sizes)
        if sizes[root] > limit:
            raise LimitExceeded(
                f"{param}: the Lark terminal {root} written out (terminals named inside it in full) is more than "
                f"{limit} characters, the grammar limit (--max-grammar-length)",
                param=param,
                code="grammar_terminal_too_large",
            )
