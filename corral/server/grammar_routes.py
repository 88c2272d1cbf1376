"""`POST /v1/grammars` (compile a constraint without generating) and `GET /v1/capabilities` (what this
server can decode under), for callers that choose a mode before they call (corral/mediation/)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import ConfigDict

from corral.grammars.enforcement import keyword_enforcement
from corral.grammars.spec import GrammarKind, JsonWhitespace
from corral.server.errors import ApiError, bad_request
from corral.server.modes import MODES
from corral.server.openai.finish import FinishReason
from corral.server.openai.frontend import OpenAIFrontend
from corral.server.openai.protocol import ConstraintFields
from corral.server.prepared import json_styled


class GrammarRequest(ConstraintFields):
    """The constraint fields of a chat request, and nothing else."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    json_leading_whitespace: bool | None = None  # as on chat: compiles what a generation would
    json_whitespace: JsonWhitespace | None = None


def grammar_routes(frontend: OpenAIFrontend) -> APIRouter:
    router = APIRouter()
    service = frontend.service

    @router.get("/v1/capabilities")
    async def capabilities() -> dict[str, Any]:
        enabled, markers = service.backend_capabilities()
        return {
            "object": "capabilities",
            "modes": list(MODES),
            # How the dispatch markers ride inside a constraint: a Lark grammar with `%json`, if a backend takes it.
            "markers": markers,
            "constraint_kinds": [str(kind) for kind in GrammarKind],
            "backends": list(enabled),
            "default_backend": "auto",
            "profiles": ["full", "decode_safe"],
            "logprobs": True,
            "finish_reasons": [str(r) for r in FinishReason if r is not FinishReason.ABORT],
            "max_model_len": service.max_len,
        }

    @router.post("/v1/grammars")
    async def compile_grammar(req: GrammarRequest) -> dict[str, Any]:
        if not service.ready:
            raise ApiError(503, "the server is starting or stopping; retry shortly", type_="service_unavailable")
        # The same parsing, limits and 400s as a chat request's constraint.
        tools = await service.off_loop(frontend.tools, req.tools, req.tool_choice, req.parallel_tool_calls)
        constraint = await service.off_loop(frontend.constraint, req, tools)
        constraint = json_styled(constraint, req.json_leading_whitespace, frontend.settings, req.json_whitespace)
        spec = constraint.spec
        if spec is None:
            raise bad_request("no constraint given: send response_format, structured_outputs or tools",
                              param="response_format")
        compiled = await service.compile(constraint)  # the same compile, cache and 400s as generation
        used = compiled.compiled.spec
        return {
            "object": "grammar",
            "kind": str(spec.kind),
            "key": spec.key,
            "backend": compiled.backend,
            "profile": "decode_safe" if used.decode_safe else "full",
            "requested_backend": constraint.backend,
            "cache_hit": compiled.cache_hit,
            "compile_ms": round(compiled.compile_ms, 3),
            # None for grammars, regexes and choices: the engine enforces all of it while decoding.
            "keywords": keyword_enforcement(used, compiled.backend),
        }

    return router
