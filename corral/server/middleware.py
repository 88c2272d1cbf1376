"""The app's middleware besides API keys (corral/server/auth.py): request ids, CORS, answered exceptions, and the
HTTP-level request limits, checked before the body is parsed: its size (413, while it is read, so a 1 GB
body costs at most the limit) and its JSON nesting depth (400, measured on the raw bytes, so neither
the JSON parser nor any recursive code after it meets a document deeper than the limit).

The constraint-level limits (schema depth/nodes/$refs, regex and grammar length, choices, tools) live in
corral/grammars/limits.py; `Settings.input_limits` builds them from the server settings."""

from __future__ import annotations

import numpy as np
from prometheus_client import Counter
from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from corral.server.errors import InternalErrorMiddleware, send_error
from corral.server.metrics import Metrics
from corral.server.request_context import RequestIdMiddleware, install_log_record_factory
from corral.server.settings import Settings

_STEP = np.zeros(256, dtype=np.int8)
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def json_depth(body: bytes) -> int:
    """The deepest bracket nesting of a JSON text, brackets inside strings ignored. The escapes that involve
    quotes go first (escaped backslashes, then escaped quotes: a run of backslashes pairs from its left, as
    the parser reads it); then the parity of the quotes seen so far tells inside from outside, and the
    outside's brackets are counted. Each step is one vectorised pass (bytes.replace, numpy). On text that
    is not JSON the figure is meaningless but harmless: the parser refuses that text next."""
    codes = np.frombuffer(body.replace(b"\\\\", b"").replace(b'\\"', b""), dtype=np.uint8)
    # Odd quote count so far: inside a string (uint8 wraps, parity survives).
    inside = np.cumsum(codes == ord('"'), dtype=np.uint8) & 1
    steps = _STEP[codes]
    steps = steps[(steps != 0) & (inside == 0)]
    return int(np.cumsum(steps, dtype=np.int32).max()) if steps.size else 0


class BodyLimitMiddleware:
    """Reads a request body up to `max_body_bytes` (413 past it, before reading further), refuses one nested
    deeper than `max_json_depth`, and hands the body it read to the app unchanged."""

    def __init__(self, app: ASGIApp, *, max_body_bytes: int, max_json_depth: int, refusals: Counter) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_json_depth = max_json_depth
        self.refusals = refusals

    async def _too_large(self, send: Send) -> None:
        """The rest of the body is never read, so the connection closes after this answer."""
        self.refusals.labels("request_too_large").inc()
        message = f"the request body is larger than {self.max_body_bytes} bytes (limit --max-body-bytes)"
        await send_error(send, 413, message, code="request_too_large", close=True)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await self._too_large(send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body: nothing to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._too_large(send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        depth = json_depth(body)
        if depth > self.max_json_depth:
            self.refusals.labels("json_too_deep").inc()
            limit = self.max_json_depth
            text = f"the request body nests {depth} levels deep; the limit is {limit} (--max-json-depth)"
            await send_error(send, 400, text, code="json_too_deep")
            return
        await self.app(scope, _replay(body, receive), send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the app the body already read, then passes on (e.g. a later disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers") or []:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def add_inner_middleware(app: Starlette, settings: Settings, metrics: Metrics) -> None:
    """Inside the API-key check: unexpected exceptions answered (innermost), then the body limits."""
    app.add_middleware(InternalErrorMiddleware, counter=metrics.internal_errors)
    app.add_middleware(
        BodyLimitMiddleware,
        max_body_bytes=settings.max_body_bytes,
        max_json_depth=settings.max_json_depth,
        refusals=metrics.limit_refusals,
    )


def add_outer_middleware(app: Starlette, settings: Settings) -> None:
    """Outside the API-key check: CORS (a browser's preflight carries no key) when enabled, and request ids
    outermost, so every answer carries one and every log line of the request names it."""
    origins = settings.cors_origins()
    if origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=origins,
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type", "X-Request-Id"],
            expose_headers=["X-Request-Id"],
        )
    install_log_record_factory()
    app.add_middleware(RequestIdMiddleware)
