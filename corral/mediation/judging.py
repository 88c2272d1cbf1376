"""Tier 2 of a mediated call: an answer judged in full (markers, JSON, every accepted schema version, the typed
parse, the semantic rules), as a value the round logic (mediator.py) acts on."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

import openai
from pydantic import ValidationError

from corral.mediation.failures import TRUNCATING_REASONS, Failure, FailureClass
from corral.mediation.markers import MarkerError, extract_block
from corral.mediation.schemas import OutputSchema
from corral.mediation.validators import SemanticValidator

T = TypeVar("T")

# 400 codes/params by which a provider says "I cannot decode under this constraint" (corral's and OpenAI's).
_UNSUPPORTED_CODES = frozenset({"unsupported_schema", "invalid_grammar", "grammar_compile_timeout"})
_CONSTRAINT_PARAMS = ("response_format", "structured_outputs")


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def __add__(self, other: Usage) -> Usage:
        return Usage(self.prompt_tokens + other.prompt_tokens, self.completion_tokens + other.completion_tokens)


@dataclass
class Outcome(Generic[T]):
    """One round's answer as judged: failures (empty when it passed), the typed value, and what was checked."""

    failures: list[Failure] = field(default_factory=list)
    value: T | None = None
    version: str | None = None
    raw: str | None = None
    finish_reason: str | None = None
    usage: Usage = field(default_factory=Usage)
    confidence: float | None = None
    checks: dict[str, bool] = field(default_factory=dict)


@dataclass(frozen=True)
class AnswerCheck(Generic[T]):
    """What every answer of one mediated call is checked against."""

    output: OutputSchema[T]
    validators: Sequence[SemanticValidator[T]]
    markers: bool

    def judge(self, answer: Any) -> Outcome[T]:
        outcome: Outcome[T] = Outcome()
        if isinstance(answer, BaseException):
            outcome.failures.append(provider_failure(answer))
            return outcome
        if answer.usage is not None:
            outcome.usage = Usage(answer.usage.prompt_tokens, answer.usage.completion_tokens)
        if not answer.choices:
            outcome.failures.append(Failure(FailureClass.PROVIDER_ERROR, "the answer has no choices"))
            return outcome
        choice = answer.choices[0]
        extra = choice.model_extra or {}
        outcome.finish_reason = extra.get("corral_finish_reason") or choice.finish_reason
        outcome.raw = choice.message.content or ""
        outcome.confidence = confidence(choice.logprobs)
        if outcome.finish_reason in TRUNCATING_REASONS:
            outcome.failures.append(Failure(FailureClass.TRUNCATED,
                                            f"the answer was cut short ({outcome.finish_reason})",
                                            finish_reason=outcome.finish_reason))
            return outcome
        self.check_text(outcome.raw, outcome)
        outcome.failures = [replace(f, finish_reason=outcome.finish_reason) for f in outcome.failures]
        return outcome

    def check_text(self, text: str, outcome: Outcome[T]) -> None:
        payload = text
        if self.markers:
            try:
                payload = extract_block(text)
            except MarkerError as exc:
                outcome.checks["markers"] = False
                outcome.failures.append(Failure(FailureClass.MARKER_MISSING, str(exc)))
                return
            outcome.checks["markers"] = True
        try:
            value = json.loads(payload)
        except json.JSONDecodeError as exc:
            outcome.checks["json"] = False
            outcome.failures.append(Failure(FailureClass.JSON_PARSE_FAILED, f"not JSON: {exc}"))
            return
        outcome.checks["json"] = True
        self.check_value(value, outcome)

    def check_value(self, value: Any, outcome: Outcome[T]) -> None:
        checked = self.output.check(value)
        outcome.checks["schema"] = checked.version is not None
        if checked.version is None:
            outcome.failures.append(Failure(FailureClass.SCHEMA_INVALID, checked.error or "", path=checked.path))
            return
        try:
            typed = self.output.parse(checked.value)
        except (ValidationError, ValueError, KeyError, TypeError) as exc:
            outcome.checks["schema"] = False
            message = f"does not parse as {self.output.name}: {exc}"
            outcome.failures.append(Failure(FailureClass.SCHEMA_INVALID, message))
            return
        for validator in self.validators:
            violation = validator.validate(typed)
            outcome.checks[validator.name] = violation is None
            if violation is not None:
                outcome.failures.append(Failure(FailureClass.SEMANTIC_INVALID, violation.message,
                                                validator=validator.name, path=violation.path))
        outcome.value, outcome.version = typed, checked.version


def provider_failure(exc: BaseException) -> Failure:
    """What a provider's exception means for the round: it cannot decode under the constraint, or it failed."""
    if isinstance(exc, openai.APIStatusError) and exc.status_code in (400, 422):
        body = exc.body if isinstance(exc.body, dict) else {}
        error = body.get("error", body) if isinstance(body.get("error", body), dict) else {}
        code, param = str(error.get("code") or ""), str(error.get("param") or "")
        if code in _UNSUPPORTED_CODES or param.startswith(_CONSTRAINT_PARAMS):
            return Failure(FailureClass.MODE_UNSUPPORTED, exc.message, finish_reason=code or None)
    return Failure(FailureClass.PROVIDER_ERROR, f"{type(exc).__name__}: {exc}")


def confidence(logprobs: Any) -> float | None:
    """The geometric-mean token probability of an answer, when its logprobs came."""
    entries = getattr(logprobs, "content", None) or []
    values = [e.logprob for e in entries if e.logprob is not None]
    if not values:
        return None
    return math.exp(sum(values) / len(values))
