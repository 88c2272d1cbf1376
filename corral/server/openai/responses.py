"""OpenAI's response shapes for chat and text completions: the whole answer as one body, or streamed as
chunks (content or tool-call deltas, logprobs, the final chunk with corral's extras, usage, `[DONE]`)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse

from corral.server.errors import ApiError, error_body
from corral.server.openai.choices import choice_body, chunk_choice, expand, logprobs_body, run_choices, stream_choices
from corral.server.openai.extras import response_extras
from corral.server.openai.frontend import OpenAIFrontend
from corral.server.openai.protocol import _Request
from corral.server.openai.tools import ToolCallStream
from corral.server.prepared import Finished, Prepared
from corral.structured import Trip

HUNG = str(Trip.HUNG_STEP)


async def respond(
    frontend: OpenAIFrontend, req: _Request, prepared: Prepared, *, chat: bool
) -> JSONResponse | EventSourceResponse:
    """The response to a prepared request: one JSON body, or a stream of server-sent events."""
    service = frontend.service
    created = int(time.time())
    prefix = "chatcmpl" if chat else "cmpl"
    response_id = f"{prefix}-{prepared.request_id}"
    choices = expand(prepared, req.n)
    if req.stream:
        events = _stream(frontend, req, choices, response_id, created, chat)
        # sse-starlette ends open streams at once on SIGTERM; the grace lets them finish within the drain.
        return EventSourceResponse(
            service.guarded(events),
            ping=15,
            shutdown_grace_period=frontend.settings.shutdown_timeout_s,
        )
    done = await run_choices(service, choices)
    hung = next((d for d in done if d.finish_reason == HUNG), None)
    if hung is not None:
        raise ApiError(503, hung.seq.error or "the engine hung", type_="server_error", code="engine_hung")
    return JSONResponse(_final_body(frontend, done, response_id, created, chat))


def _usage(prepared: Prepared, completion_tokens: int) -> dict[str, int]:
    prompt = len(prepared.prompt_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens, "total_tokens": prompt + completion_tokens}


def _final_body(frontend: OpenAIFrontend, done: list[Finished], rid: str, created: int, chat: bool) -> dict[str, Any]:
    service = frontend.service
    tokenizer = service.tokenizer
    choices = [
        choice_body(
            i,
            d,
            chat=chat,
            logprobs=logprobs_body(d.seq.logprobs, d.prepared, tokenizer, chat=chat),
            finish_mode=frontend.settings.finish_reasons,
            extras=response_extras(d) if len(done) > 1 else None,
        )
        for i, d in enumerate(done)
    ]
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": service.model_name,
        "choices": choices,
        "usage": _usage(done[0].prepared, sum(len(d.seq.output_ids) for d in done)),
        **response_extras(done[0]),  # with n > 1, each choice also carries its own
    }


async def _stream(
    frontend: OpenAIFrontend, req: _Request, choices: list[Prepared], rid: str, created: int, chat: bool
) -> AsyncGenerator[str, None]:
    service = frontend.service
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choice: dict[str, Any]) -> dict[str, Any]:
        return {"id": rid, "object": obj, "created": created, "model": service.model_name, "choices": [choice]}

    mode = frontend.settings.finish_reasons
    # A tool-call answer's content stays null unless it turns out to be text; its calls go out as deltas.
    tool_streams = [ToolCallStream.of(p.constraint) if chat else None for p in choices]
    if chat:
        for index, tools in enumerate(tool_streams):
            first = chunk_choice(index, None if tools else "", None, chat=chat, finish_mode=mode, first=True)
            yield json.dumps(chunk(first))
    streamed: list[list[int]] = [[] for _ in choices]  # token ids whose logprobs went out, per choice
    completion_tokens = 0
    async with aclosing(stream_choices(service, choices)) as outputs:
        async for index, out, done in outputs:
            prepared, tools = choices[index], tool_streams[index]
            tokenizer = service.tokenizer
            logprobs = logprobs_body(out.logprobs, prepared, tokenizer, chat=chat, before=streamed[index])
            streamed[index] += [e.token for e in out.logprobs]
            if tools is not None:
                for fields in tools.feed(out.delta or "", final=out.finished):
                    piece = chunk_choice(index, None, None, chat=chat, finish_mode=mode, fields=fields)
                    yield json.dumps(chunk(piece))
            if not out.finished:
                if out.delta and tools is None:
                    piece = chunk_choice(index, out.delta, None, chat=chat, finish_mode=mode, logprobs=logprobs)
                    yield json.dumps(chunk(piece))
                continue
            assert done is not None
            if done.finish_reason == HUNG:
                error = error_body(done.seq.error or "the engine hung", type_="server_error", code="engine_hung")
                yield json.dumps(error)
                return
            text = None if tools else out.delta or None
            last = chunk(chunk_choice(index, text, done.finish_reason, chat=chat, finish_mode=mode, logprobs=logprobs))
            last.update(response_extras(done))
            yield json.dumps(last)
            completion_tokens += len(done.seq.output_ids)
    if req.include_usage():
        usage_chunk = chunk({})
        usage_chunk.update(choices=[], usage=_usage(choices[0], completion_tokens))
        yield json.dumps(usage_chunk)
    yield "[DONE]"
