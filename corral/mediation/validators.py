"""Tier 2's semantic half: rules a schema cannot say (cross-field, business), as one small protocol."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

T_contra = TypeVar("T_contra", contravariant=True)
V = TypeVar("V")


@dataclass(frozen=True)
class Violation:
    message: str
    path: str | None = None  # JSON pointer, where the rule is about one field


@runtime_checkable
class SemanticValidator(Protocol[T_contra]):
    """`validate` returns None when the value holds, else what is wrong (fit to show the model)."""

    @property
    def name(self) -> str: ...

    def validate(self, value: T_contra) -> Violation | None: ...


@dataclass(frozen=True)
class Rule:
    """A SemanticValidator from a predicate: `check(value)` True means it holds."""

    name: str
    check: Callable[[Any], bool]
    message: str
    path: str | None = None
    decode_hint: dict[str, Any] | None = None

    def validate(self, value: Any) -> Violation | None:
        try:
            holds = self.check(value)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            return Violation(f"{self.message} (could not evaluate: {type(exc).__name__}: {exc})", self.path)
        return None if holds else Violation(self.message, self.path)


def decode_hint(validator: object) -> dict[str, Any] | None:
    """A validator's rule said as JSON Schema, if it has one (a `decode_hint` attribute): on a repair round the
    mediator adds it (allOf) to the decode-time constraint where the mode carries one, so the engine enforces
    the rule the model just broke instead of hoping the prompt does."""
    hint = getattr(validator, "decode_hint", None)
    return hint if isinstance(hint, dict) else None
