"""FastAPI app factory: the OpenAI-compatible routes over one Service."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette.sse import EventSourceResponse

from samplers.watchdog import Trip
from server.auth import ApiKeyMiddleware
from server.errors import ApiError
from server.openai.finish import finish_fields
from server.openai.tools import ToolCallStream, chat_message
from server.protocol import ChatCompletionRequest, CompletionRequest, _Request, error_body
from server.serving import Finished, Prepared, Service

log = logging.getLogger(__name__)

HUNG = str(Trip.HUNG_STEP)


def create_app(service: Service) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if not service.ready:
            service.start()
        yield
        service.stop()

    app = FastAPI(title="corral", version="0.1.0", lifespan=lifespan)
    app.state.service = service
    if service.settings.api_keys():
        app.add_middleware(
            ApiKeyMiddleware, keys=service.settings.api_keys(), protect_metrics=service.settings.metrics_require_key
        )

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(error_body(exc.message, type_=exc.type, param=exc.param, code=exc.code), exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
        return JSONResponse(error_body(message, param=param), 400)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", type_="server_error"), 500)

    @app.get("/health")
    async def health() -> JSONResponse:
        if not service.ready or not service.healthy or not service.loop.alive:
            return JSONResponse({"status": "unavailable"}, 503)
        return JSONResponse(
            {
                "status": "ok",
                "running": len(service.engine.scheduler.running),
                "waiting": len(service.engine.scheduler.waiting),
            }
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": service.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "corral",
                    "max_model_len": service.engine.max_len,
                }
            ],
        }

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(req: ChatCompletionRequest) -> JSONResponse | EventSourceResponse:
        prepared = await service.prepare(req, service.chat_prompt(req), prompt_param="messages")
        return await _respond(service, req, prepared, chat=True)

    @app.post("/v1/completions", response_model=None)
    async def completions(req: CompletionRequest) -> JSONResponse | EventSourceResponse:
        prepared = await service.prepare(req, service.completion_prompt(req), prompt_param="prompt")
        return await _respond(service, req, prepared, chat=False)

    return app


async def _respond(
    service: Service, req: _Request, prepared: Prepared, *, chat: bool
) -> JSONResponse | EventSourceResponse:
    created = int(time.time())
    prefix = "chatcmpl" if chat else "cmpl"
    response_id = f"{prefix}-{prepared.request_id}"
    if req.stream:
        return EventSourceResponse(_stream(service, req, prepared, response_id, created, chat), ping=15)
    done = await service.run(prepared)
    if done.finish_reason == HUNG:
        raise ApiError(503, done.seq.error or "the engine hung", type_="server_error", code="engine_hung")
    return JSONResponse(_final_body(service, prepared, done, response_id, created, chat))


def _usage(prepared: Prepared, completion_tokens: int) -> dict[str, int]:
    prompt = len(prepared.prompt_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens, "total_tokens": prompt + completion_tokens}


def _final_body(
    service: Service, prepared: Prepared, done: Finished, rid: str, created: int, chat: bool
) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, **finish_fields(done.finish_reason, service.settings.finish_reasons)}
    choice["logprobs"] = None
    if chat:
        choice["message"] = chat_message(done.text, done.check)
    else:
        choice["text"] = done.text
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": service.model_name,
        "choices": [choice],
        "usage": _usage(prepared, len(done.seq.output_ids)),
        **service.extras(done),
    }


async def _stream(
    service: Service, req: _Request, prepared: Prepared, rid: str, created: int, chat: bool
) -> AsyncIterator[str]:
    obj = "chat.completion.chunk" if chat else "text_completion"

    tool_stream = ToolCallStream.of(prepared.constraint) if chat else None

    def chunk(
        delta: str | None, finish_reason: str | None, first: bool = False, fields: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, **finish_fields(finish_reason, service.settings.finish_reasons)}
        choice["logprobs"] = None
        if chat:
            content: dict[str, Any] = {"role": "assistant"} if first else {}
            if delta is not None:
                content["content"] = delta
            choice["delta"] = {**content, **(fields or {})}
        else:
            choice["text"] = delta or ""
        return {"id": rid, "object": obj, "created": created, "model": service.model_name, "choices": [choice]}

    if chat:  # a tool-call answer's content stays null unless it turns out to be text
        yield json.dumps(chunk(None if tool_stream else "", None, first=True))
    async for out in service.stream(prepared):
        if tool_stream is not None:  # calls (or text) as OpenAI's deltas, the last one's with the finish
            for fields in tool_stream.feed(out.delta or "", final=out.finished):
                yield json.dumps(chunk(None, None, fields=fields))
        if not out.finished:
            if out.delta and tool_stream is None:
                yield json.dumps(chunk(out.delta, None))
            continue
        done = service.finish(prepared, out)
        if done.finish_reason == HUNG:
            yield json.dumps(error_body(done.seq.error or "the engine hung", type_="server_error", code="engine_hung"))
            return
        last = chunk(None if tool_stream else out.delta or None, done.finish_reason)
        last.update(service.extras(done))
        yield json.dumps(last)
        if req.include_usage():
            usage_chunk = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": service.model_name,
                "choices": [],
                "usage": _usage(prepared, len(done.seq.output_ids)),
            }
            yield json.dumps(usage_chunk)
    yield "[DONE]"
