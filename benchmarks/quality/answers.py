"""One answer as results.json keeps it: what the server said (status, finish reasons, tokens, time) and the
judge's verdict on it."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from benchmarks.quality.scoring import score
from benchmarks.quality.tasks import Item, Task
from benchmarks.serve.client import Reply

TEXT_KEPT = 400  # characters of each answer kept, for reading failures


@dataclass(frozen=True)
class Answer:
    server: str  # "corral" or "peer"
    task: str
    mode: str
    item_id: str
    api: str
    status: str  # ok | refused (400) | error
    http_status: int | None = None
    finish_reason: str | None = None  # OpenAI's value
    corral_finish_reason: str | None = None  # corral's precise one (absent on a peer)
    completion_tokens: int = 0
    client_ms: float | None = None
    parsed: bool = False
    valid: bool = False
    exact: bool = False
    field_accuracy: float = 0.0
    fields: dict[str, bool] = field(default_factory=dict)
    overlong: bool = False
    value: Any = None
    text: str | None = None
    error: str | None = None
    backend: str | None = None  # grammar.backend: which engine corral used

    @property
    def finish(self) -> str:
        """The precise reason where the server gives one (corral), else OpenAI's; refusals and errors by status."""
        if self.status != "ok":
            return self.status
        return str(self.corral_finish_reason or self.finish_reason)


def judge(task: Task, item: Item, *, server: str, mode: str, api: str, reply: Reply) -> Answer:
    """The reply to one request, judged. A refusal or error keeps its message and scores nothing."""
    head = Answer(server, task.name, mode, item.item_id, api, reply.status, reply.http_status,
                  client_ms=reply.client_ms, fields={f.name: False for f in task.scored_fields(item)})
    if reply.payload is None:
        return replace(head, error=reply.error)
    payload = reply.payload
    choice = payload["choices"][0]
    message = choice.get("message")
    if isinstance(message, dict):
        content, calls = message.get("content"), message.get("tool_calls")
    else:
        content, calls = choice.get("text"), None
    verdict = score(task, item, content if isinstance(content, str) else None, calls if isinstance(calls, list)
                    else None)
    text = content if isinstance(content, str) else (str(calls) if calls else None)
    return replace(
        head, finish_reason=choice.get("finish_reason"),
        corral_finish_reason=choice.get("corral_finish_reason"),
        completion_tokens=int((payload.get("usage") or {}).get("completion_tokens") or 0),
        parsed=verdict.parsed, valid=verdict.valid, exact=verdict.exact, field_accuracy=verdict.field_accuracy,
        fields=verdict.fields, overlong=verdict.overlong, value=verdict.value,
        text=None if text is None else text[:TEXT_KEPT], error=verdict.error,
        backend=(payload.get("grammar") or {}).get("backend"),
    )
