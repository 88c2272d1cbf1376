"""A finished answer as a Responses API `response` object: output items, a status that says why it ended, usage
and corral's extras.

Status follows chat's finish-reason mapping (corral/server/openai/finish.py), so a failed constraint is never
`completed`: an answer cut by the budget (or closed early, or stalled) is `incomplete` with reason
`max_output_tokens`; one that broke its contract or reached a dead end is `incomplete` with reason
`content_filter` (the output is withheld from the contract, as chat's `content_filter`); an engine failure is
`failed` with an error. corral's precise reason travels in `corral_finish_reason`.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from corral.grammars.spec import GrammarKind
from corral.server.engine.logprobs import TokenLogprob
from corral.server.openai.choices import logprobs_body
from corral.server.openai.extras import response_extras
from corral.server.openai.finish import FinishReason, openai_finish_reason
from corral.server.openai.responses_api.request import ResponsesRequest
from corral.server.openai.tools import chat_message
from corral.server.prepared import Finished, Prepared


@dataclass(frozen=True)
class Outcome:
    status: str  # completed | incomplete | failed
    incomplete_details: dict[str, str] | None = None
    error: dict[str, str] | None = None

    @classmethod
    def of(cls, done: Finished) -> Outcome:
        if done.finish_reason == FinishReason.ERROR:
            message = done.seq.error or "the engine failed this request"
            return cls("failed", error={"code": "server_error", "message": message})
        shown = openai_finish_reason(done.finish_reason)
        if shown in ("stop", "tool_calls"):
            return cls("completed")
        return cls("incomplete", {"reason": "max_output_tokens" if shown == "length" else "content_filter"})

    @property
    def item_status(self) -> str:
        return "completed" if self.status == "completed" else "incomplete"


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def message_item(
    text: str, status: str, item_id: str | None = None, logprobs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id or new_id("msg"),
        "role": "assistant",
        "status": status,
        "content": [text_part(text, logprobs)],
    }


def text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def text_logprobs(entries: list[TokenLogprob], prepared: Prepared, tokenizer: Any) -> list[dict[str, Any]]:
    """`output_text.logprobs` for these tokens (chat's entries: token, logprob, bytes, top_logprobs); none when
    the request did not ask, or when the answer is a tool-call answer (its text is not the tokens')."""
    spec = prepared.constraint.spec
    if spec is not None and spec.kind is GrammarKind.TOOL_CALLS:
        return []
    body = logprobs_body(entries, prepared, tokenizer, chat=True)
    return list(body["content"]) if body else []


def call_item(
    name: str, arguments: str, status: str, *, call_id: str | None = None, item_id: str | None = None
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id or new_id("fc"),
        "call_id": call_id or new_id("call"),
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_items(done: Finished, outcome: Outcome, tokenizer: Any) -> list[dict[str, Any]]:
    """The answer's items: its function calls (only when they passed the contract), else one message."""
    message = chat_message(done.text, done.check)
    calls = message.get("tool_calls")
    if calls:
        return [
            call_item(c["function"]["name"], c["function"]["arguments"], outcome.item_status, call_id=c["id"])
            for c in calls
        ]
    logprobs = text_logprobs(done.seq.logprobs, done.prepared, tokenizer)
    return [message_item(message["content"] or "", outcome.item_status, logprobs=logprobs)]


def usage(prompt_tokens: int, output_tokens: int) -> dict[str, Any]:
    # cached_tokens stays 0: corral does not count prefix-cache hits per request (docs/api.md).
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + output_tokens,
    }


def response_body(
    req: ResponsesRequest, response_id: str, created: int, model: str, *, status: str = "in_progress"
) -> dict[str, Any]:
    """The response object as far as the request decides it; `finished_body` adds the answer."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": model,
        "output": [],
        "parallel_tool_calls": req.parallel_tool_calls,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tool_choice": req.tool_choice or "auto",
        "tools": req.tools or [],
        "text": {"format": req.text_format() or {"type": "text"}},
        "truncation": "disabled",
        "store": False,
        "background": False,
        "metadata": {},
        "usage": None,
    }


def finished_body(
    base: dict[str, Any], done: Finished, outcome: Outcome, output: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        **base,
        "status": outcome.status,
        "error": outcome.error,
        "incomplete_details": outcome.incomplete_details,
        "output": output,
        "usage": usage(len(done.prepared.prompt_ids), len(done.seq.output_ids)),
        "corral_finish_reason": done.finish_reason,
        **response_extras(done),
    }
