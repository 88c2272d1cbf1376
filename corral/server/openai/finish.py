"""Finish reasons: corral's precise ones, and the OpenAI value each is reported as.

OpenAI's clients validate `finish_reason` against a closed set (stop, length, tool_calls, content_filter,
function_call); some reject anything else, some rewrite it to `stop`, which would make a failed constraint read
as success. So by default every failure maps to `length` or `content_filter`, the two values the SDK's `parse`
raises on, and the precise reason travels in `corral_finish_reason` beside it.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

from corral.structured import Trip

FinishReasonMode = Literal["openai", "precise"]
EXTRA_FIELD = "corral_finish_reason"


class FinishReason(StrEnum):
    """Every way a corral request ends (the engine's, the watchdog's and the output check's)."""

    STOP = "stop"  # a stop token, a stop string, or the grammar completed; the output is valid
    LENGTH = "length"  # max_tokens or the context ran out first
    CLOSED = "closed"  # closed early with the grammar's shortest completion (budget or runaway); the output is valid
    TOOL_CALLS = "tool_calls"  # the answer is a (valid) tool call
    INVALID_OUTPUT = "invalid_output"  # the grammar completed, but the full contract does not hold
    ERROR = "error"  # the engine or grammar engine failed this request
    ABORT = "abort"  # the client went away (never sent)
    DEAD_END = Trip.DEAD_END.value
    STALL = Trip.STALL.value
    MASK_TIMEOUT = Trip.MASK_TIMEOUT.value
    REVISION_DEPTH_EXCEEDED = Trip.REVISION_DEPTH_EXCEEDED.value
    HUNG_STEP = Trip.HUNG_STEP.value  # answered as a 503, never as a finish reason


# Cut short before the answer was complete: OpenAI's `length`. An answer that is complete but wrong,
# or that no token could continue, or that the engine failed: `content_filter` (the output is withheld
# from the contract). Both make the SDK's `parse` raise instead of returning.
_OPENAI: dict[FinishReason, str] = {
    FinishReason.STOP: "stop",
    FinishReason.TOOL_CALLS: "tool_calls",
    FinishReason.LENGTH: "length",
    FinishReason.CLOSED: "length",  # honest about the budget: the model did not finish the answer itself
    FinishReason.STALL: "length",
    FinishReason.MASK_TIMEOUT: "length",
    FinishReason.REVISION_DEPTH_EXCEEDED: "length",
    FinishReason.INVALID_OUTPUT: "content_filter",
    FinishReason.DEAD_END: "content_filter",
    FinishReason.ERROR: "content_filter",
    FinishReason.ABORT: "content_filter",
    FinishReason.HUNG_STEP: "content_filter",
}
OPENAI_FINISH_REASONS = frozenset({"stop", "length", "tool_calls", "content_filter", "function_call"})


def openai_finish_reason(reason: str) -> str:
    """The OpenAI enum value for corral's `reason`; an unknown reason is a failure, never `stop`."""
    try:
        return _OPENAI[FinishReason(reason)]
    except ValueError:
        return reason if reason in OPENAI_FINISH_REASONS and reason != "stop" else "content_filter"


def finish_fields(reason: str | None, mode: FinishReasonMode) -> dict[str, Any]:
    """The choice's `finish_reason` and `corral_finish_reason` (None on chunks before the last)."""
    if reason is None:
        return {"finish_reason": None}
    shown = reason if mode == "precise" else openai_finish_reason(reason)
    return {"finish_reason": shown, EXTRA_FIELD: reason}
