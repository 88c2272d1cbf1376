"""Judging tool-call answers (OpenAI's response shape) and counting them. Pure: no HTTP, no server."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from corral.benchmarks.jsonschemabench.dataset import SchemaCase
from corral.benchmarks.tools.workload import function_name
from corral.grammars.contract import validate_output
from corral.grammars.spec import GrammarSpec

TEXT_KEPT = 300
_NUMBER = re.compile(r"\d+")


@dataclass(frozen=True)
class CallVerdict:
    """One returned `tool_calls[i]`: its name, and its `function.arguments` (a JSON string) against the
    schema with the full validator (JSON Schema 2020-12 + formats)."""

    name: str | None
    name_ok: bool
    valid: bool
    error: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class ToolResult:
    case_id: str
    status: str  # ok | refused (400) | error
    http_status: int | None = None
    finish_reason: str | None = None
    calls: tuple[CallVerdict, ...] = ()
    content: str | None = None
    completion_tokens: int = 0
    client_ms: float | None = None
    error: str | None = None


def judge_calls(message: dict[str, Any], case: SchemaCase) -> tuple[CallVerdict, ...]:
    spec = GrammarSpec.json_schema(case.schema)
    verdicts = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            verdicts.append(CallVerdict(None, False, False, "tool call without a function object"))
            continue
        name, arguments = function.get("name"), function.get("arguments")
        name_ok = name == function_name(case)
        if not isinstance(arguments, str):
            verdicts.append(CallVerdict(name, name_ok, False, f"arguments is {type(arguments).__name__}, "
                                        "not a JSON string"))
            continue
        check = validate_output(spec, arguments)
        error = check.error if name_ok else f"unexpected function name {name!r}; {check.error or 'arguments valid'}"
        verdicts.append(CallVerdict(name, name_ok, check.valid and name_ok, error, arguments[:TEXT_KEPT]))
    return tuple(verdicts)


def judge_answer(case: SchemaCase, payload: dict[str, Any], client_ms: float | None = None) -> ToolResult:
    """A 200 answer: the first choice's tool calls judged, finish reason and any text content kept."""
    choice = payload["choices"][0]
    message = choice.get("message") or {}
    content = message.get("content")
    return ToolResult(
        case.case_id, "ok", 200, choice.get("corral_finish_reason", choice.get("finish_reason")),
        judge_calls(message, case),
        content[:TEXT_KEPT] if isinstance(content, str) else None,
        int((payload.get("usage") or {}).get("completion_tokens") or 0), client_ms)


@dataclass
class Summary:
    tried: int = 0
    refused: int = 0
    errors: int = 0
    answered: int = 0
    with_tool_calls: int = 0
    without_tool_calls: int = 0
    calls: int = 0
    calls_valid: int = 0
    calls_invalid: int = 0
    wrong_name: int = 0
    finish_mismatch: int = 0  # answers with tool calls whose finish_reason is not "tool_calls", or vice versa
    finish_reasons: dict[str, int] = field(default_factory=dict)
    refusal_messages: dict[str, int] = field(default_factory=dict)

    @property
    def compliance(self) -> float | None:
        """Returned calls whose arguments validate ÷ returned calls (the issue's "every call validates")."""
        return self.calls_valid / self.calls if self.calls else None

    @property
    def call_rate(self) -> float | None:
        """Answered requests that carried at least one call ÷ answered requests (tool_choice=required: 1)."""
        return self.with_tool_calls / self.answered if self.answered else None

    def as_dict(self) -> dict[str, Any]:
        return {**vars(self), "compliance": self.compliance, "call_rate": self.call_rate}


def refusal_key(message: str | None) -> str:
    """Refusal messages grouped: the first clause (schema-specific detail after ':' dropped), numbers as N
    ("the prompt is N tokens; this model's context is N tokens ...")."""
    return _NUMBER.sub("N", (message or "no message").split(":")[0].strip())[:120]


def summarize(results: Sequence[ToolResult]) -> Summary:
    s = Summary(tried=len(results))
    finishes: Counter[str] = Counter()
    refusals: Counter[str] = Counter()
    for r in results:
        if r.status == "refused":
            s.refused += 1
            refusals[refusal_key(r.error)] += 1
            continue
        if r.status != "ok":
            s.errors += 1
            continue
        s.answered += 1
        finishes[str(r.finish_reason)] += 1
        if r.calls:
            s.with_tool_calls += 1
        else:
            s.without_tool_calls += 1
        if bool(r.calls) != (r.finish_reason == "tool_calls"):
            s.finish_mismatch += 1
        s.calls += len(r.calls)
        s.calls_valid += sum(1 for c in r.calls if c.valid)
        s.calls_invalid += sum(1 for c in r.calls if not c.valid)
        s.wrong_name += sum(1 for c in r.calls if not c.name_ok)
    s.finish_reasons = dict(finishes)
    s.refusal_messages = dict(refusals.most_common())
    return s
