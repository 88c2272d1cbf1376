"""generate mode: constrained generation per schema × backend, in process or against a running corral."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

from corral.benchmarks.jsonschemabench.conformance import validate_generated
from corral.benchmarks.jsonschemabench.dataset import SchemaCase

log = logging.getLogger(__name__)

PROMPT = "Reply with a JSON value that matches the JSON Schema the server enforces."
TEXT_KEPT = 400  # characters of each output kept in the results, for reading failures


@dataclass(frozen=True)
class GenerateOptions:
    max_tokens: int
    gen_timeout_s: float
    compile_timeout_s: float
    temperature: float = 0.0
    seed: int = 0


@dataclass(frozen=True)
class Reply:
    """What one request produced, whichever way it was served."""

    status: str  # ok | rejected | timeout (compile) | gen_timeout | error
    text: str = ""
    finish_reason: str | None = None
    routed: str | None = None
    timings: dict[str, Any] | None = None
    error: str | None = None
    profile: str | None = None  # `decode_safe` when auto compiled the relaxed schema behind the guard


def request_body(case: SchemaCase, backend: str, options: GenerateOptions) -> dict[str, Any]:
    # The schema itself is not in the prompt: the grammar carries it, and big schemas (Kubernetes) would
    # otherwise dominate prefill time and overflow small contexts.
    hint = f"{PROMPT} Schema title: {case.schema.get('title', '')}" if isinstance(case.schema, dict) else PROMPT
    return {
        "messages": [{"role": "user", "content": hint[:500]}],
        "max_tokens": options.max_tokens,
        "temperature": options.temperature,
        "seed": options.seed,
        "structured_outputs": {"json": case.schema, "backend": backend},
    }


class Generator(Protocol):
    async def generate(self, case: SchemaCase, backend: str, options: GenerateOptions) -> Reply: ...

    async def close(self) -> None: ...


def status_of_refusal(code: str | None) -> str:
    return "timeout" if code == "grammar_compile_timeout" else "rejected"


class InProcessGenerator:
    """corral's own Service on `model` (else $CORRAL_MODEL, else the default model), no HTTP in between."""

    def __init__(self, options: GenerateOptions, backends: list[str], model: str | None = None) -> None:
        from pathlib import Path

        from corral.server.models import load_model
        from corral.server.serving import Service
        from corral.server.settings import Settings

        named = [b for b in backends if b != "auto"]
        # Without `model`, the server's own choice: $CORRAL_MODEL, else the default model (on the CPU).
        chosen = {"model": Path(model)} if model else {"device": "cpu"}
        settings = Settings.model_validate({
            **chosen,
            "compile_timeout_s": options.compile_timeout_s,
            # `auto` needs both engines to route between, whichever single backends are benchmarked.
            "backends": ",".join(dict.fromkeys([*named, "xgrammar", "llguidance"])),
            "max_model_len": max(1024, options.max_tokens + 512),
        })
        self._service = Service(settings, load_model(settings.model, device=settings.device))
        self._service.start()

    async def generate(self, case: SchemaCase, backend: str, options: GenerateOptions) -> Reply:
        from corral.server.errors import ApiError
        from corral.server.openai.extras import response_extras
        from corral.server.openai.frontend import OpenAIFrontend
        from corral.server.openai.protocol import ChatCompletionRequest

        service = self._service
        request = ChatCompletionRequest(**request_body(case, backend, options))
        try:
            prepared = await OpenAIFrontend(service, service.settings).prepare_chat(request)
        except ApiError as exc:
            return Reply(status_of_refusal(exc.code), error=exc.message[:500])
        try:
            finished = await asyncio.wait_for(service.run(prepared), options.gen_timeout_s)
        except TimeoutError:
            return Reply("gen_timeout", error=f"no answer within {options.gen_timeout_s:g} s")
        extras = response_extras(finished)
        grammar = extras.get("grammar") or {}
        return Reply("ok", finished.text, finished.finish_reason, grammar.get("backend"), extras.get("timings"),
                     profile=grammar.get("profile"))

    async def close(self) -> None:
        self._service.stop()


class ServerGenerator:
    """A running corral reached over HTTP (the only network access the benchmark makes)."""

    def __init__(self, base_url: str, options: GenerateOptions) -> None:
        import httpx

        self._client = httpx.AsyncClient(
            base_url=base_url.rstrip("/"), timeout=options.gen_timeout_s + options.compile_timeout_s
        )

    async def generate(self, case: SchemaCase, backend: str, options: GenerateOptions) -> Reply:
        import httpx

        try:
            response = await self._client.post("/v1/chat/completions", json=request_body(case, backend, options))
        except httpx.TimeoutException:
            return Reply("gen_timeout", error="HTTP request timed out")
        except httpx.HTTPError as exc:
            return Reply("error", error=f"{type(exc).__name__}: {exc}")
        body: Any = response.json() if response.headers.get("content-type", "").startswith("application/json") else {}
        if response.status_code == 400:
            error = body.get("error", {}) if isinstance(body, dict) else {}
            return Reply(status_of_refusal(error.get("code")), error=str(error.get("message", ""))[:500])
        if response.status_code != 200 or not isinstance(body, dict):
            return Reply("error", error=f"HTTP {response.status_code}: {response.text[:300]}")
        choice = body["choices"][0]
        grammar = body.get("grammar") or {}
        # corral_finish_reason: the precise reason (finish_reason stays in OpenAI's enum by default)
        reason = choice.get("corral_finish_reason", choice.get("finish_reason"))
        return Reply("ok", choice["message"].get("content") or "", reason,
                     grammar.get("backend"), body.get("timings"), profile=grammar.get("profile"))

    async def close(self) -> None:
        await self._client.aclose()


async def run_generate(
    generator: Generator, case: SchemaCase, backend: str, options: GenerateOptions
) -> dict[str, Any]:
    """One record for `case` × `backend`; `valid` is judged here, not by the server."""
    start = time.perf_counter()
    reply = await generator.generate(case, backend, options)
    timings = reply.timings or {}
    record: dict[str, Any] = {
        "mode": "generate", "subset": case.subset, "schema": case.name, "backend": backend,
        "status": reply.status, "routed": reply.routed, "error": reply.error,
        "decode_safe": reply.profile == "decode_safe",
        "finish_reason": reply.finish_reason,
        "gct_ms": timings.get("compile_ms"), "ttft_ms": timings.get("ttft_ms"), "tpot_ms": timings.get("tpot_ms"),
        "wall_ms": round((time.perf_counter() - start) * 1000, 3),
    }
    if reply.status == "ok":
        verdict = validate_generated(case.schema, reply.text)
        record.update(valid=verdict.valid, validation_error=verdict.error, text=reply.text[:TEXT_KEPT])
    else:
        record["valid"] = False
    return record
