"""Request ids: each HTTP request gets one (the caller's `X-Request-Id` if it is a sane token, else a new
one), returns it as a response header, and every log line written while serving it carries it."""

from __future__ import annotations

import copy
import logging
import re
import uuid
from contextvars import ContextVar
from typing import Any

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = "x-request-id"
NO_REQUEST = "-"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"
# A caller's id is echoed into headers and logs: printable token characters only, bounded length.
_SANE_ID = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")

request_id: ContextVar[str] = ContextVar("corral_request_id", default=NO_REQUEST)


def current_request_id() -> str:
    return request_id.get()


def _choose_id(scope: Scope) -> str:
    for name, value in scope.get("headers") or []:
        if name == HEADER.encode():
            text = bytes(value).decode("latin-1")
            if _SANE_ID.fullmatch(text):
                return text
            break
    return uuid.uuid4().hex


class RequestIdMiddleware:
    """Outermost middleware: sets the id before anything else runs, so even an auth refusal or a body
    limit's 413 carries it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = _choose_id(scope)
        token = request_id.set(rid)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[HEADER] = rid
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            request_id.reset(token)


_installed = False


def install_log_record_factory() -> None:
    """Give every LogRecord a `request_id` attribute (the current request's, or "-"), whichever logger or
    handler it goes to, so a format string can print it. Idempotent."""
    global _installed
    if _installed:
        return
    previous = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        record.request_id = request_id.get()
        return record

    logging.setLogRecordFactory(factory)
    _installed = True


def uvicorn_log_config() -> dict[str, Any]:
    """uvicorn's own logging config with the request id in both its formats (access lines included)."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    for formatter in config["formatters"].values():
        formatter["fmt"] = formatter["fmt"].replace("%(levelprefix)s", "%(levelprefix)s [%(request_id)s]", 1)
    return config
