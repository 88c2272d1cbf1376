"""API keys: with keys configured, /v1/* (and /metrics if asked) require `Authorization: Bearer <key>`."""

from __future__ import annotations

import hmac
import json
from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from corral.server.openai.protocol import error_body


class ApiKeyMiddleware:
    """Plain ASGI (not BaseHTTPMiddleware), so streamed responses pass through untouched."""

    def __init__(self, app: ASGIApp, keys: Iterable[str], *, protect_metrics: bool = False) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys]
        self.protect_metrics = protect_metrics

    def _protected(self, path: str) -> bool:
        return path.startswith("/v1/") or path == "/v1" or (self.protect_metrics and path == "/metrics")

    def _authorized(self, scope: Scope) -> bool:
        header = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        token = token.strip()
        # Compare against every key in constant time, so timing tells nothing about which one nearly matched.
        return any([hmac.compare_digest(token, key) for key in self.keys])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or not self._protected(scope["path"]) or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        has_header = any(name == b"authorization" for name, _ in scope.get("headers") or [])
        message = (
            "incorrect API key provided" if has_header else "an API key is required: send `Authorization: Bearer <key>`"
        )
        body = json.dumps(error_body(message, code="invalid_api_key")).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b'Bearer realm="corral"'),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
