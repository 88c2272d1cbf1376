"""A streamed Responses API answer as the typed events the SDK's stream helpers fold into a response:
`response.created`, `response.in_progress`, per output item `response.output_item.added` then its content
(`response.content_part.added`, `response.output_text.delta`... for a message; `response.function_call_
arguments.delta`... for a call) and its `.done` events, and last `response.completed` (or `.incomplete`,
`.failed`) with the whole response. Every event carries its `type` and an increasing `sequence_number`.

Items open as the answer's text shows them (a tool-call answer through chat's ToolCallStream); when the answer
ends, each is closed with its final value and keeps the ids it was announced with, so the final response and
the events describe the same items.
"""

from __future__ import annotations

import copy
import itertools
import json
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from corral.server.errors import error_body
from corral.server.openai.choices import stream_choices
from corral.server.openai.finish import FinishReason
from corral.server.openai.responses_api.output import (
    Outcome,
    call_item,
    finished_body,
    message_item,
    output_items,
    text_logprobs,
    text_part,
)
from corral.server.openai.tools import ToolCallStream
from corral.server.prepared import Finished, Prepared
from corral.server.serving import Service

Event = tuple[str, dict[str, Any]]  # (type, fields)


class StreamedItems:
    """The output items a stream has opened, in order, with what was sent of each."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._calls: dict[int, int] = {}  # tool-call index in the answer -> output index

    def on_piece(self, piece: dict[str, Any], logprobs: list[dict[str, Any]] | None = None) -> list[Event]:
        """Events for one piece of a chat delta: `{"content": text}` (with its tokens' logprobs, if asked) or
        `{"tool_calls": [...]}`."""
        if piece.get("content"):
            return self._text(piece["content"], logprobs or [])
        events: list[Event] = []
        for call in piece.get("tool_calls") or []:
            events += self._call(call)
        return events

    def _text(self, delta: str, logprobs: list[dict[str, Any]]) -> list[Event]:
        events: list[Event] = []
        if not self.items or self.items[-1]["type"] != "message":
            item = message_item("", "in_progress")
            item["content"] = []
            events += self._added(item)
            item["content"].append(text_part(""))
            events.append(("response.content_part.added", {**self._where(item), "part": text_part("")}))
        item = self.items[-1]
        item["content"][0]["text"] += delta
        events.append(("response.output_text.delta", {**self._where(item), "delta": delta, "logprobs": logprobs}))
        return events

    def _call(self, call: dict[str, Any]) -> list[Event]:
        events: list[Event] = []
        index, function = call["index"], call.get("function") or {}
        if index not in self._calls:
            self._calls[index] = len(self.items)
            events += self._added(call_item(function.get("name", ""), "", "in_progress", call_id=call.get("id")))
        item = self.items[self._calls[index]]
        piece = function.get("arguments") or ""
        if piece:
            item["arguments"] += piece
            where = {"item_id": item["id"], "output_index": self._calls[index]}
            events.append(("response.function_call_arguments.delta", {**where, "delta": piece}))
        return events

    def _added(self, item: dict[str, Any]) -> list[Event]:
        self.items.append(item)
        # A copy: the item grows as its content streams, the event says how it began.
        return [("response.output_item.added", {"output_index": len(self.items) - 1, "item": copy.deepcopy(item)})]

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.items.index(item), "content_index": 0}

    def close(self, final: list[dict[str, Any]], status: str) -> tuple[list[Event], list[dict[str, Any]]]:
        """The `.done` events and the response's output. The final items take the ids they were announced with;
        an answer whose final items differ in kind from what streamed (calls that failed their contract come
        back as text) keeps the streamed items, marked with the answer's status."""
        opened = [item["type"] for item in self.items]
        if opened != [item["type"] for item in final][: len(opened)]:
            final = [{**item, "status": status} for item in self.items]
            for item in final:
                if item["type"] == "message" and not item["content"]:
                    item["content"] = [text_part("")]
        events: list[Event] = []
        for index, item in enumerate(final):
            if index < len(self.items):
                keep = ("id", "call_id") if item["type"] == "function_call" else ("id",)
                item.update({key: self.items[index][key] for key in keep})
            else:  # nothing of it streamed (an empty text): announce it now
                events += self._added_late(item)
            events += _done_events(item, index)
        return events, final

    def _added_late(self, item: dict[str, Any]) -> list[Event]:
        index = len(self.items)
        self.items.append(item)
        announced = {**item, "status": "in_progress"}
        if item["type"] == "function_call":
            announced["arguments"] = ""
            return [("response.output_item.added", {"output_index": index, "item": announced})]
        announced["content"] = []
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [
            ("response.output_item.added", {"output_index": index, "item": announced}),
            ("response.content_part.added", {**where, "part": text_part("")}),
        ]


def _done_events(item: dict[str, Any], index: int) -> list[Event]:
    if item["type"] == "function_call":
        where = {"item_id": item["id"], "output_index": index}
        return [
            ("response.function_call_arguments.done", {**where, "name": item["name"], "arguments": item["arguments"]}),
            ("response.output_item.done", {"output_index": index, "item": item}),
        ]
    part = item["content"][0]
    where = {"item_id": item["id"], "output_index": index, "content_index": 0}
    return [
        ("response.output_text.done", {**where, "text": part["text"], "logprobs": part["logprobs"]}),
        ("response.content_part.done", {**where, "part": part}),
        ("response.output_item.done", {"output_index": index, "item": item}),
    ]


async def response_events(
    service: Service, prepared: Prepared, base: dict[str, Any]
) -> AsyncGenerator[dict[str, str], None]:
    """The server-sent events of one streamed response (`base`: the response object before the answer)."""
    numbers = itertools.count()

    def event(kind: str, fields: dict[str, Any]) -> dict[str, str]:
        return {"event": kind, "data": json.dumps({"type": kind, "sequence_number": next(numbers), **fields})}

    yield event("response.created", {"response": base})
    yield event("response.in_progress", {"response": base})
    items = StreamedItems()
    tools = ToolCallStream.of(prepared.constraint)
    tokenizer = service.tokenizer
    done: Finished | None = None
    async with aclosing(stream_choices(service, [prepared])) as outputs:
        async for _, out, finished in outputs:
            delta = out.delta or ""
            pieces = tools.feed(delta, final=out.finished) if tools else [{"content": delta}]
            logprobs = text_logprobs(out.logprobs, prepared, tokenizer)
            for piece in pieces:
                for kind, fields in items.on_piece(piece, logprobs):
                    yield event(kind, fields)
            if out.finished:
                done = finished
    assert done is not None
    if done.finish_reason == FinishReason.HUNG_STEP:
        error = error_body(done.seq.error or "the engine hung", type_="server_error", code="engine_hung")
        yield {"data": json.dumps(error)}
        return
    outcome = Outcome.of(done)
    closing, output = items.close(output_items(done, outcome, tokenizer), outcome.item_status)
    for kind, fields in closing:
        yield event(kind, fields)
    final = finished_body(base, done, outcome, output)
    yield event(f"response.{outcome.status}", {"response": final})

