"""Every object inside a JSON value, in document order: the one walk that schema readers share (routing rules,
required names, references, property order), iterative so a deep schema costs no recursion."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def objects_in(value: Any) -> Iterator[dict[str, Any]]:
    """Each dict in `value` (itself included), parents before children, siblings in document order."""
    stack: list[Any] = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            yield node
            stack.extend(reversed(list(node.values())))
        elif isinstance(node, list):
            stack.extend(reversed(node))
