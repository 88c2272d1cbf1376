"""Drive a running corral over HTTP: N requests with at most `concurrency` in flight."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from corral.benchmarks.serve.peer import peer_timings
from corral.benchmarks.serve.stats import RequestResult
from corral.benchmarks.serve.workload import BenchCase, case_spec, request_body
from corral.grammars.contract import validate_output

TEXT_KEPT = 300  # characters of each answer kept in results.json, for reading failures


@dataclass(frozen=True)
class Endpoint:
    """A server the benchmark drives and how a request is spelled for it: corral gets
    `structured_outputs` with a backend; a peer gets its served model name and its own constraint field.
    Both get the run's sampling (greedy by default)."""

    name: str = "corral"
    backend: str | None = "auto"
    constraint: str = "structured_outputs"
    model: str | None = None
    temperature: float = 0.0
    top_p: float = 1.0


CORRAL = Endpoint()


@dataclass(frozen=True)
class Reply:
    """One POST as the client saw it: `ok` (200 with a JSON object), `refused` (400, with the server's
    message) or `error` (anything else, transport failures included)."""

    status: str
    http_status: int | None = None
    payload: dict[str, Any] | None = None
    client_ms: float | None = None
    error: str | None = None


async def post(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> Reply:
    """One POST: `ok` (200 with choices), `refused` (400, with the server's message) or `error`."""
    start = time.perf_counter()
    try:
        response = await client.post(path, json=body)
    except httpx.HTTPError as exc:
        return Reply("error", error=f"{type(exc).__name__}: {exc}")
    client_ms = (time.perf_counter() - start) * 1000
    try:
        payload: Any = response.json()
    except ValueError:
        payload = None
    if response.status_code == 200 and isinstance(payload, dict) and payload.get("choices"):
        return Reply("ok", 200, payload, client_ms)
    error = payload.get("error", {}) if isinstance(payload, dict) else {}
    message = error.get("message") if isinstance(error, dict) else None
    return Reply("refused" if response.status_code == 400 else "error", response.status_code, None, client_ms,
                 str(message or response.text)[:500])


async def post_chat(client: httpx.AsyncClient, body: dict[str, Any]) -> Reply:
    return await post(client, "/v1/chat/completions", body)


async def send(client: httpx.AsyncClient, case: BenchCase, *, mode: str, concurrency: int, max_tokens: int,
               endpoint: Endpoint = CORRAL) -> RequestResult:
    constrained = mode == "constrained"
    body = request_body(case, constrained=constrained, max_tokens=max_tokens, backend=endpoint.backend,
                        constraint=endpoint.constraint, model=endpoint.model, temperature=endpoint.temperature,
                        top_p=endpoint.top_p)
    reply = await post_chat(client, body)
    if reply.payload is None:
        return RequestResult(mode, concurrency, case.case_id, reply.status, http_status=reply.http_status,
                             client_ms=reply.client_ms, error=reply.error, server=endpoint.name)
    payload = reply.payload
    choice = payload["choices"][0]
    text = (choice.get("message") or {}).get("content") or ""
    # corral names its precise reason apart from the OpenAI one; a peer only has finish_reason.
    finish = choice.get("corral_finish_reason", choice.get("finish_reason"))
    valid: bool | None = None
    if constrained and finish == "stop":
        # Judged here against the full schema, not taken from the server's own `grammar.schema_valid`.
        valid = validate_output(case_spec(case), text).valid
    grammar = payload.get("grammar") or {}
    timings = payload.get("timings") or {}
    if endpoint.name != "corral":
        timings = peer_timings(timings)
    return RequestResult(
        mode, concurrency, case.case_id, "ok", http_status=200, finish_reason=finish,
        completion_tokens=int((payload.get("usage") or {}).get("completion_tokens") or 0), client_ms=reply.client_ms,
        timings=timings, backend=grammar.get("backend"), valid=valid, text=text[:TEXT_KEPT],
        server=endpoint.name,
    )


async def run_level(client: httpx.AsyncClient, cases: Sequence[BenchCase], *, mode: str, concurrency: int,
                    max_tokens: int, endpoint: Endpoint = CORRAL,
                    on_done: Callable[[RequestResult], None] | None = None,
                    ) -> tuple[list[RequestResult], float]:
    """All `cases` (in order) through a semaphore of `concurrency`; returns the results and the wall seconds
    from the first send to the last answer."""
    gate = asyncio.Semaphore(concurrency)

    async def one(case: BenchCase) -> RequestResult:
        async with gate:
            result = await send(client, case, mode=mode, concurrency=concurrency, max_tokens=max_tokens,
                                endpoint=endpoint)
        if on_done is not None:
            on_done(result)
        return result

    start = time.perf_counter()
    results = await asyncio.gather(*(one(c) for c in cases))
    return list(results), time.perf_counter() - start


def make_client(base_url: str, timeout_s: float, concurrency: int, api_key: str | None = None) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=max(concurrency, 1) + 4, max_keepalive_connections=max(concurrency, 1) + 4)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    return httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout_s, limits=limits, headers=headers)
