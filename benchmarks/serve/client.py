"""Drive a running corral over HTTP: N requests with at most `concurrency` in flight."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from benchmarks.jsonschemabench.dataset import SchemaCase
from benchmarks.serve.stats import RequestResult
from benchmarks.serve.workload import request_body
from grammars.spec import GrammarSpec
from grammars.validation import validate_output

TEXT_KEPT = 300  # characters of each answer kept in results.json, for reading failures


async def send(client: httpx.AsyncClient, case: SchemaCase, *, mode: str, concurrency: int, max_tokens: int,
               backend: str) -> RequestResult:
    constrained = mode == "constrained"
    body = request_body(case, constrained=constrained, max_tokens=max_tokens, backend=backend)
    start = time.perf_counter()
    try:
        response = await client.post("/v1/chat/completions", json=body)
    except httpx.HTTPError as exc:
        return RequestResult(mode, concurrency, case.case_id, "error", error=f"{type(exc).__name__}: {exc}")
    client_ms = (time.perf_counter() - start) * 1000
    try:
        payload: Any = response.json()
    except ValueError:
        payload = None
    if response.status_code != 200 or not isinstance(payload, dict):
        error = payload.get("error", {}) if isinstance(payload, dict) else {}
        message = error.get("message") if isinstance(error, dict) else None
        return RequestResult(mode, concurrency, case.case_id, "refused" if response.status_code == 400 else "error",
                             http_status=response.status_code, client_ms=client_ms,
                             error=str(message or response.text)[:500])
    choice = payload["choices"][0]
    text = choice["message"].get("content") or ""
    finish = choice.get("finish_reason")
    valid: bool | None = None
    if constrained and finish == "stop":
        # Judged here against the full schema, not taken from the server's own `grammar.schema_valid`.
        valid = validate_output(GrammarSpec.json_schema(case.schema), text).valid
    grammar = payload.get("grammar") or {}
    return RequestResult(
        mode, concurrency, case.case_id, "ok", http_status=200, finish_reason=finish,
        completion_tokens=int((payload.get("usage") or {}).get("completion_tokens") or 0), client_ms=client_ms,
        timings=payload.get("timings") or {}, backend=grammar.get("backend"), valid=valid, text=text[:TEXT_KEPT],
    )


async def run_level(client: httpx.AsyncClient, cases: Sequence[SchemaCase], *, mode: str, concurrency: int,
                    max_tokens: int, backend: str, on_done: Callable[[RequestResult], None] | None = None,
                    ) -> tuple[list[RequestResult], float]:
    """All `cases` (in order) through a semaphore of `concurrency`; returns the results and the wall seconds
    from the first send to the last answer."""
    gate = asyncio.Semaphore(concurrency)

    async def one(case: SchemaCase) -> RequestResult:
        async with gate:
            result = await send(client, case, mode=mode, concurrency=concurrency, max_tokens=max_tokens,
                                backend=backend)
        if on_done is not None:
            on_done(result)
        return result

    start = time.perf_counter()
    results = await asyncio.gather(*(one(c) for c in cases))
    return list(results), time.perf_counter() - start


def make_client(base_url: str, timeout_s: float, concurrency: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=max(concurrency, 1) + 4, max_keepalive_connections=max(concurrency, 1) + 4)
    return httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout_s, limits=limits)
