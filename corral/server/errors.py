"""Errors as OpenAI-shaped HTTP responses `{"error": {"message", "type", "param", "code"}}`, everywhere:
corral's own refusals (ApiError), request bodies FastAPI cannot parse or validate, unknown routes (404),
wrong methods (405), and unexpected exceptions (500, logged with the request id and counted, the
connection kept usable)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from contextlib import aclosing
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import Counter
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from corral.grammars.limits import LimitExceeded
from corral.server.request_context import current_request_id

log = logging.getLogger(__name__)

ECHO_LIMIT = 200  # characters of a caller's value an error message may repeat
MESSAGE_LIMIT = 2_000  # characters of any error message
# limit codes not raised as corral.grammars.limits.LimitExceeded
COUNTED_LIMITS = frozenset({"context_length_exceeded"})


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def clip(text: str, limit: int = ECHO_LIMIT) -> str:
    """At most `limit` characters of `text`: an error names the offending part, it does not echo a request."""
    if len(text) <= limit:
        return text
    keep = max(limit - 20, 1)
    return f"{text[:keep]}… ({len(text) - keep} more characters)"


def error_body(
    message: str, *, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    *,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    body = error_body(clip(message, MESSAGE_LIMIT), type_=type_, param=param and clip(param), code=code)
    return JSONResponse(body, status, headers=dict(headers) if headers else None)


def _line_column(doc: str, pos: int) -> tuple[int, int]:
    line = doc.count("\n", 0, pos) + 1
    return line, pos - (doc.rfind("\n", 0, pos) + 1) + 1


def _validation_response(exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first: dict[str, Any] = dict(errors[0]) if errors else {"loc": (), "msg": "invalid request"}
    loc = tuple(first.get("loc", ()))
    if first.get("type") == "json_invalid" and len(loc) == 2 and isinstance(loc[1], int):
        # FastAPI reports the character offset as the location; as a `param` that read like a field ("28").
        doc = exc.body if isinstance(exc.body, str) else ""
        line, column = _line_column(doc, loc[1])
        reason = (first.get("ctx") or {}).get("error", "JSON decode error")
        message = f"the request body is not valid JSON: {reason} at line {line}, column {column} (char {loc[1]})"
        return error_response(400, message, code="invalid_json")
    if loc == ("body",):
        return error_response(
            400,
            f"the request body must be a JSON object (Content-Type: application/json): {first.get('msg')}",
            code="invalid_body",
        )
    param = ".".join(str(p) for p in loc if p != "body") or None
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    return error_response(400, message, param=param)


def _http_response(request: Request, exc: HTTPException) -> JSONResponse:
    path = clip(request.url.path)
    if exc.status_code == 404:
        return error_response(404, f"no such endpoint: {request.method} {path}", code="unknown_url")
    if exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        return error_response(
            405,
            f"method {request.method} is not allowed on {path}" + (f"; use {allowed}" if allowed else ""),
            code="method_not_allowed",
            headers=exc.headers,
        )
    cause = exc.__cause__
    if exc.status_code == 400 and isinstance(cause, UnicodeDecodeError):
        return error_response(
            400, f"the request body is not valid UTF-8 (byte {cause.start}: {cause.reason})", code="invalid_json"
        )
    if exc.status_code == 400 and isinstance(cause, RecursionError):
        return error_response(400, "the request body nests too deeply to parse", code="json_too_deep")
    if exc.status_code == 400 and cause is not None:  # FastAPI's "There was an error parsing the body"
        return error_response(400, f"the request body could not be parsed: {type(cause).__name__}", code="invalid_json")
    type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return error_response(exc.status_code, str(exc.detail), type_=type_, headers=exc.headers)


def install_error_handlers(app: FastAPI, limit_refusals: Counter) -> None:
    """Every error FastAPI/Starlette would answer in their own shape, answered in OpenAI's; refusals by a
    request limit are counted under the limit's code."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        if exc.code is not None and (exc.code in COUNTED_LIMITS or isinstance(exc.__cause__, LimitExceeded)):
            limit_refusals.labels(exc.code).inc()
        return error_response(exc.status, exc.message, type_=exc.type, param=exc.param, code=exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_response(exc)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return _http_response(request, exc)


async def guard_stream(
    events: AsyncGenerator[str | dict[str, str], None], internal_errors: Counter
) -> AsyncIterator[str | dict[str, str]]:
    """A streamed answer's events; an exception after the headers went out (too late for a status code) ends
    the stream with an error event in OpenAI's shape instead of a cut connection: an ApiError as itself,
    anything else as `internal_error`, logged with the request id and counted."""
    try:
        async with aclosing(events) as inner:
            async for event in inner:
                yield event
    except ApiError as exc:
        yield json.dumps(error_body(clip(exc.message, MESSAGE_LIMIT), type_=exc.type, param=exc.param, code=exc.code))
    except Exception:
        log.exception("internal error while streaming")
        internal_errors.inc()
        yield json.dumps(error_body(internal_error_message(), type_="server_error", code="internal_error"))


class InternalErrorMiddleware:
    """Answers an exception no handler took. Starlette's own last resort re-raises after its 500, and
    uvicorn then drops the keep-alive connection; this one answers a 500 in OpenAI's shape (a 400 for a
    RecursionError, which only hostile nesting reaches), logs it with the request id, counts it, and
    returns normally, so the connection carries the client's next request."""

    def __init__(self, app: ASGIApp, *, counter: Counter) -> None:
        self.app = app
        self.counter = counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except RecursionError:
            log.warning("request nested too deeply: %s %s", scope["method"], clip(scope["path"]))
            if not started:
                await send_error(send, 400, "the request nests too deeply to process", code="too_deep")
        except Exception:
            log.exception("internal error on %s %s", scope["method"], clip(scope["path"]))
            self.counter.inc()
            if not started:
                await send_error(send, 500, internal_error_message(), type_="server_error", code="internal_error")


def internal_error_message() -> str:
    return f"internal error; the server log has the details under request id {current_request_id()}"


async def send_error(
    send: Send,
    status: int,
    message: str,
    *,
    code: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    close: bool = False,
) -> None:
    """An OpenAI-shaped error answered at the ASGI level (middleware, where no handler runs). `close`: the
    connection cannot carry another request (e.g. a body left unread)."""
    body = json.dumps(error_body(message, type_=type_, param=param, code=code), separators=(",", ":")).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
