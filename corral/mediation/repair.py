"""Tier 3: how many rounds, which failures are worth another, the repair turn, and escalation."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from corral.mediation.failures import Failure, FailureClass


@dataclass(frozen=True)
class Escalation:
    """Handed to the human-review hook when the budget is spent on repairable failures."""

    schema_name: str
    messages: list[dict[str, Any]]  # the original conversation (before any repair turn)
    last_output: str | None
    failures: list[Failure]


# Returns a value for a human-approved answer (validated like a model's), or None to give up.
EscalationHook = Callable[[Escalation], Any]


@dataclass(frozen=True)
class RepairPolicy:
    """`max_attempts` rounds at most. Semantic failures are repaired (the errors go into the next turn);
    structural ones fail fast: `structural_retries` more rounds in all (003: one retry, then terminal);
    `mode_unsupported` degrades to the next mode instead; `provider_error` is never retried here (the SDK
    has its own retries). When the budget ends on a semantic failure, `escalate` (if given) gets the case."""

    max_attempts: int = 3
    structural_retries: int = 1
    escalate: EscalationHook | None = None
    retry_on_provider_error: bool = False
    repairable: frozenset[FailureClass] = field(default_factory=lambda: frozenset({FailureClass.SEMANTIC_INVALID}))

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.structural_retries < 0:
            raise ValueError("max_attempts must be >= 1 and structural_retries >= 0")

    def next_round(self, failures: list[Failure]) -> bool:
        """Whether to try again after `failures` (one per round so far, the last one just now)."""
        if len(failures) >= self.max_attempts:
            return False
        last = failures[-1].cls
        if last is FailureClass.PROVIDER_ERROR:
            return self.retry_on_provider_error
        if last is FailureClass.MODE_UNSUPPORTED or last in self.repairable:
            return True
        skipped = {*self.repairable, FailureClass.MODE_UNSUPPORTED}
        structural = sum(1 for f in failures if f.cls not in skipped)
        return structural <= self.structural_retries


def repair_message(failures: list[Failure], *, markers: bool) -> str:
    """The user turn after a rejected answer: what was wrong, precisely, and what to send instead."""
    lines = "\n".join(f"- {f.describe()}" for f in failures)
    shape = "the JSON inside one BEGIN_DISPATCH_RESULT … END_DISPATCH_RESULT block" if markers else "only the JSON"
    return f"Your previous answer was rejected:\n{lines}\nFix these problems and answer again with {shape}."
