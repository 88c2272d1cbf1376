"""FastAPI app factory: middleware, then the routes (health, metrics, models, grammars, chat and text
completions, responses) over one Service and its OpenAI front end."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette.sse import EventSourceResponse

from corral.server.auth import ApiKeyMiddleware
from corral.server.errors import install_error_handlers
from corral.server.grammar_routes import grammar_routes
from corral.server.middleware import add_inner_middleware, add_outer_middleware
from corral.server.models.weight_count import weight_elements
from corral.server.openai.frontend import OpenAIFrontend
from corral.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from corral.server.openai.responses import respond
from corral.server.openai.responses_api.request import ResponsesRequest
from corral.server.openai.responses_api.route import respond_responses
from corral.server.serving import Service
from corral.server.settings import Settings

RECURSION_LIMIT = 20_000  # jsonschema recurses a few frames per schema level: room for --max-schema-depth


def create_app(service: Service, settings: Settings) -> FastAPI:
    """The app over `service`; `settings` are those it was built from (middleware, keys and limits read them)."""
    sys.setrecursionlimit(max(sys.getrecursionlimit(), RECURSION_LIMIT))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if not service.ready:
            service.start()
        yield
        service.stop()

    app = FastAPI(title="corral", version="0.1.0", lifespan=lifespan)
    loaded = service.loaded
    elements = weight_elements(loaded.path)
    weight_bytes = elements * loaded.dtype.itemsize if elements is not None else None
    read_bytes = getattr(loaded.model, "step_read_bytes", None)
    if loaded.quantization != "none" and callable(read_bytes):  # what the quantized weights are, not the file
        weight_bytes = int(read_bytes())
    frontend = OpenAIFrontend(service, settings)
    app.state.service = service
    app.state.frontend = frontend
    # Middleware, innermost first (docs/reliability.md): 500s, body limits, API keys, CORS, request ids.
    counters = service.metrics
    add_inner_middleware(app, settings, counters)
    if settings.api_keys():
        app.add_middleware(ApiKeyMiddleware, keys=settings.api_keys(), protect_metrics=settings.metrics_require_key)
    add_outer_middleware(app, settings)
    install_error_handlers(app, counters.limit_refusals)

    @app.get("/health")
    async def health() -> JSONResponse:
        if not service.healthy:
            return JSONResponse({"status": "unavailable"}, 503)
        running, waiting = service.queue_depths()
        return JSONResponse({"status": "ok", "running": running, "waiting": waiting})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(counters.registry), media_type=CONTENT_TYPE_LATEST)

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
                    "max_model_len": service.max_len,
                    "dtype": str(loaded.dtype).removeprefix("torch."),
                    "quantization": loaded.quantization,
                    "weight_bytes": weight_bytes,  # at the serving dtype (or quantized): what one decode step reads
                }
            ],
        }

    app.include_router(grammar_routes(frontend))  # /v1/capabilities, /v1/grammars

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(req: ChatCompletionRequest) -> JSONResponse | EventSourceResponse:
        return await respond(frontend, req, await frontend.prepare_chat(req), chat=True)

    @app.post("/v1/completions", response_model=None)
    async def completions(req: CompletionRequest) -> JSONResponse | EventSourceResponse:
        return await respond(frontend, req, await frontend.prepare_completion(req), chat=False)

    @app.post("/v1/responses", response_model=None)
    async def responses(req: ResponsesRequest) -> JSONResponse | EventSourceResponse:
        return await respond_responses(frontend, req)

    return app
