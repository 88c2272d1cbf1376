"""One answer as results.json keeps it: what the server said (status, finish reasons, tokens, time) and the
judge's verdict on it."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from corral.benchmarks.quality.scoring import score
from corral.benchmarks.quality.tasks import Item, Task
from corral.benchmarks.serve.client import Reply

TEXT_KEPT = 400  # characters of each answer kept, for reading failures
NO_CALL = "no_call"  # the finish of an answer in words where tool_choice `auto` allowed a call


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
    tool_choice: str | None = None  # what a tool task's request sent (none for other tasks)
    called: bool | None = None  # a tool task's reply carried `tool_calls` (none for other tasks)

    @property
    def words_for_a_call(self) -> bool:
        """Under tool_choice `auto` the model answered in words (no call in `tool_calls`, none written as JSON
        in the text): allowed, and a miss, since there is no call to score."""
        return self.tool_choice == "auto" and self.status == "ok" and not self.called and not self.parsed

    @property
    def finish(self) -> str:
        """The precise reason where the server gives one (corral), else OpenAI's; refusals and errors by status;
        `no_call` for words that ended by themselves where a call was allowed, apart from the calls' `tool_calls`."""
        if self.status != "ok":
            return self.status
        reason = str(self.corral_finish_reason or self.finish_reason)
        return NO_CALL if self.words_for_a_call and reason == "stop" else reason


def judge(task: Task, item: Item, *, server: str, mode: str, api: str, reply: Reply,
          tool_choice: str | None = None) -> Answer:
    """The reply to one request, judged; `tool_choice` is what a tool task's request sent. A refusal or error
    keeps its message and scores nothing."""
    head = Answer(server, task.name, mode, item.item_id, api, reply.status, reply.http_status,
                  client_ms=reply.client_ms, fields={f.name: False for f in task.scored_fields(item)},
                  tool_choice=tool_choice)
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
        called=isinstance(calls, list) and bool(calls) if task.kind == "tool" else None,
    )
