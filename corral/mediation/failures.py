"""Failure classes: every way one mediation round can fail, as values (the repair loop branches on them)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class FailureClass(StrEnum):
    MARKER_MISSING = "marker_missing"  # no single trailing BEGIN/END block, or text outside it
    JSON_PARSE_FAILED = "json_parse_failed"
    SCHEMA_INVALID = "schema_invalid"  # parsed, but breaks the full schema (or the typed model)
    SEMANTIC_INVALID = "semantic_invalid"  # shape holds, a SemanticValidator refused the value
    MODE_UNSUPPORTED = "mode_unsupported"  # the provider refused the constraint this mode sends
    TRUNCATED = "truncated"  # the answer was cut short (max_tokens, context, a corral watchdog)
    PROVIDER_ERROR = "provider_error"  # transport or server failure; no answer to judge

    @property
    def structural(self) -> bool:
        """Shape failures: the answer is not the contract at all. Semantic ones are worth repairing."""
        return self is not FailureClass.SEMANTIC_INVALID


# corral's precise finish reasons (`choices[i].corral_finish_reason`) that mean "cut short".
TRUNCATING_REASONS = frozenset({"length", "stall", "mask_timeout", "revision_depth_exceeded"})


@dataclass(frozen=True)
class Failure:
    """One round's failure: its class, a message fit to show the model, and where it came from."""

    cls: FailureClass
    message: str
    validator: str | None = None  # the SemanticValidator that refused, for semantic_invalid
    path: str | None = None  # JSON pointer into the value, where known
    finish_reason: str | None = None  # the provider's precise finish reason (corral's when it is corral)

    def describe(self) -> str:
        where = f" at {self.path}" if self.path else ""
        who = f" ({self.validator})" if self.validator else ""
        return f"[{self.cls}{who}]{where} {self.message}"


class MediationError(Exception):
    """No validated value: the last failure's class, every round's failures, and whether it was escalated."""

    def __init__(self, failure: Failure, *, attempts: int, failures: list[Failure], escalated: bool = False) -> None:
        super().__init__(f"mediation failed after {attempts} attempt(s): {failure.describe()}")
        self.failure = failure
        self.failure_class = failure.cls
        self.attempts = attempts
        self.failures = failures
        self.escalated = escalated
