"""Size limits on a caller's constraint, checked before any work that scales with it.

Every walk here is iterative and stops as soon as a limit is passed, so measuring a hostile input costs
at most the limit, never the input. Once a schema is known to be within `max_schema_depth`, the recursive
code after it (jsonschema's meta-schema check, `json.dumps`, the engines' compilers) stays far from
Python's recursion limit and from the native stack.

Defaults accept every schema of JSONSchemaBench (8,499 schemas; the largest figures are in
docs/reliability.md) with room to spare.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from grammars.validation import InvalidConstraint


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
