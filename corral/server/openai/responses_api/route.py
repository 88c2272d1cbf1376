"""`POST /v1/responses`: translate to chat, prepare and run on the chat path, answer as a response object or a
stream of typed events."""

from __future__ import annotations

import time

from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse

from corral.server.errors import ApiError
from corral.server.openai.finish import FinishReason
from corral.server.openai.frontend import OpenAIFrontend
from corral.server.openai.responses_api.output import Outcome, finished_body, output_items, response_body
from corral.server.openai.responses_api.request import ResponsesRequest
from corral.server.openai.responses_api.stream import response_events
from corral.server.openai.responses_api.translate import chat_form


async def respond_responses(frontend: OpenAIFrontend, req: ResponsesRequest) -> JSONResponse | EventSourceResponse:
    service = frontend.service
    form = chat_form(req)
    try:
        prepared = await frontend.prepare_chat(form.request)
    except ApiError as exc:
        raise form.rename(exc) from exc
    base = response_body(req, f"resp_{prepared.request_id.replace('-', '')}", int(time.time()), service.model_name)
    if req.stream:
        return EventSourceResponse(
            service.guarded(response_events(service, prepared, base)),
            ping=15,
            shutdown_grace_period=frontend.settings.shutdown_timeout_s,
        )
    done = await service.run(prepared)
    if done.finish_reason == FinishReason.HUNG_STEP:
        raise ApiError(503, done.seq.error or "the engine hung", type_="server_error", code="engine_hung")
    outcome = Outcome.of(done)
    output = output_items(done, outcome, service.tokenizer)
    return JSONResponse(finished_body(base, done, outcome, output))
