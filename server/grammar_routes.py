"""`POST /v1/grammars` (compile a constraint without generating) and `GET /v1/capabilities` (what this
server can decode under), for callers that choose a mode before they call (mediation/)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import ConfigDict

from grammars.enforcement import keyword_enforcement
from grammars.request import parse_constraint
from grammars.spec import GrammarKind
from grammars.validation import InvalidConstraint
from samplers.registry import UnknownBackend
from server.errors import ApiError, bad_request
from server.openai.finish import FinishReason
from server.openai.modes import MODES
from server.openai.tools import parse_tools, tool_constraint
from server.protocol import LegacyConstraintFields
from server.serving import Service


class GrammarRequest(LegacyConstraintFields):
    """The constraint fields of a chat request, and nothing else."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True


def grammar_routes(service: Service) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/capabilities")
    async def capabilities() -> dict[str, Any]:
        return {
            "object": "capabilities",
            "modes": list(MODES),
            # How the dispatch markers ride inside a constraint: a Lark grammar with `%json` (llguidance).
            "markers": "lark_json" if "llguidance" in service.backends.enabled else None,
            "constraint_kinds": [str(kind) for kind in GrammarKind],
            "backends": list(service.backends.enabled),
            "default_backend": "auto",
            "profiles": ["full", "decode_safe"],
            "logprobs": True,
            "finish_reasons": [str(r) for r in FinishReason if r is not FinishReason.ABORT],
            "max_model_len": service.engine.max_len,
        }

    @router.post("/v1/grammars")
    async def compile_grammar(req: GrammarRequest) -> dict[str, Any]:
        if not service.ready:
            raise ApiError(503, "the server is starting or stopping; retry shortly", type_="service_unavailable")
        legacy = req.legacy_constraint()
        try:
            constraint = parse_constraint(req.response_format, req.structured_outputs, legacy)
            tools = parse_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
            constraint = tool_constraint(tools, constraint, service.tool_format)
            service.backends.check_name(constraint.backend)
        except InvalidConstraint as exc:
            raise bad_request(str(exc), param=exc.param) from exc
        except UnknownBackend as exc:
            raise bad_request(str(exc), param=constraint.backend_source) from exc
        spec = constraint.spec
        if spec is None:
            raise bad_request("no constraint given: send response_format, structured_outputs or tools",
                              param="response_format")
        compiled = await service._compile(constraint)  # the same compile, cache and 400s as generation
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
