"""Every error in OpenAI's shape `{"error": {"message", "type", "param", "code"}}` — unknown routes, wrong
methods, bodies the JSON parser refuses, field errors, unexpected exceptions — with a request id on every
answer and in every log line, and the keep-alive connection still serving afterwards."""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from corral.server.cli import main as cli_main
from corral.server.cli import settings_from_args
from corral.server.middleware import add_outer_middleware
from corral.server.settings import Settings

MODEL = "corral-tiny"
MESSAGES = [{"role": "user", "content": "hello"}]
CHOICE_OK = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "structured_outputs": {"choice": ["yes", "no"]}}
JSON = {"content-type": "application/json"}


@pytest.fixture()
def http(server: Any) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


def local_port(response: httpx.Response) -> int:
    return int(response.extensions["network_stream"].get_extra_info("socket").getsockname()[1])


def openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error: dict[str, Any] = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    return error


def assert_serves_on(http: httpx.Client, port: int) -> None:
    response = http.post("/v1/chat/completions", json=CHOICE_OK)
    assert response.status_code == 200, response.text
    assert local_port(response) == port, "the failed request's connection was dropped"


@pytest.mark.parametrize(("method", "path"), [("GET", "/v1/nothing"), ("POST", "/v1/chat/complete"), ("GET", "/")])
def test_unknown_route_is_a_404(http: httpx.Client, method: str, path: str) -> None:
    error = openai_error(http.request(method, path), 404)
    assert error["code"] == "unknown_url"
    assert f"{method} {path}" in error["message"]


@pytest.mark.parametrize(("method", "path", "allowed"), [
    ("GET", "/v1/chat/completions", "POST"), ("DELETE", "/v1/models", "GET"), ("POST", "/health", "GET"),
])
def test_wrong_method_is_a_405_naming_the_allowed_one(http: httpx.Client, method: str, path: str, allowed: str) -> None:
    response = http.request(method, path)
    error = openai_error(response, 405)
    assert error["code"] == "method_not_allowed"
    assert response.headers["allow"] == allowed
    assert allowed in error["message"]


def test_unparseable_body_names_line_and_column_not_a_param(http: httpx.Client) -> None:
    body = '{"model": "corral-tiny",\n "messages": [}'
    response = http.post("/v1/chat/completions", content=body, headers=JSON)
    error = openai_error(response, 400)
    assert error["param"] is None  # FastAPI's location was the character offset, which read like a field ("28")
    assert error["code"] == "invalid_json"
    assert "line 2, column 15" in error["message"], error["message"]
    assert_serves_on(http, local_port(response))


@pytest.mark.parametrize(("content", "content_type", "words"), [
    (b'{"model": "\xff\xfe"}', "application/json", "UTF-8"),
    (b"", "application/json", "must be a JSON object"),
    (b"hello", "text/plain", "must be a JSON object"),
    (b"[1, 2]", "application/json", "valid dictionary"),
])
def test_bodies_that_are_not_a_json_object(http: httpx.Client, content: bytes, content_type: str, words: str) -> None:
    response = http.post("/v1/chat/completions", content=content, headers={"content-type": content_type})
    error = openai_error(response, 400)
    assert words in error["message"], error["message"]
    assert_serves_on(http, local_port(response))


def test_field_errors_still_name_the_field(http: httpx.Client) -> None:
    error = openai_error(http.post("/v1/chat/completions", json={**CHOICE_OK, "temperature": 7}), 400)
    assert error["param"] == "temperature"


def test_echoed_values_are_clipped(http: httpx.Client) -> None:
    huge = "m" * 50_000
    error = openai_error(http.post("/v1/chat/completions", json={**CHOICE_OK, "model": huge}), 404)
    assert len(error["message"]) < 2_100
    error = openai_error(http.post("/v1/" + "x" * 5_000), 404)
    assert len(error["message"]) < 300


def test_unexpected_exception_is_a_500_that_keeps_the_connection(
    http: httpx.Client, server: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A real exception inside a real handler (the running front end's chat prompt step, patched for this
    test): a 500 in OpenAI's shape, logged with the request id, counted, and the connection serves on."""

    def broken_prompt(req: Any) -> list[int]:
        raise RuntimeError("secret detail from inside the server")

    before = _internal_errors(http)
    monkeypatch.setattr(server.frontend, "chat_prompt", broken_prompt)
    with caplog.at_level(logging.ERROR, logger="corral.server.errors"):
        response = http.post("/v1/chat/completions", json=CHOICE_OK, headers={"X-Request-Id": "req-500-test"})
    monkeypatch.undo()
    error = openai_error(response, 500)
    assert (error["type"], error["code"]) == ("server_error", "internal_error")
    assert "req-500-test" in error["message"]
    assert "secret detail" not in error["message"]
    assert response.headers["x-request-id"] == "req-500-test"
    logged = [r for r in caplog.records if r.name == "corral.server.errors" and r.exc_info]
    assert logged and all(getattr(r, "request_id", None) == "req-500-test" for r in logged)
    assert _internal_errors(http) == before + 1
    assert_serves_on(http, local_port(response))


def _internal_errors(http: httpx.Client) -> float:
    text = http.get("/metrics").text
    match = re.search(r"^corral_internal_errors_total (\S+)$", text, re.M)
    assert match, "corral_internal_errors_total is missing from /metrics"
    return float(match.group(1))


def test_request_ids_are_honoured_or_generated(http: httpx.Client) -> None:
    assert http.get("/health", headers={"X-Request-Id": "abc-123"}).headers["x-request-id"] == "abc-123"
    generated = http.get("/health").headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", generated)
    # An id that is not a sane token (spaces, a log-line forgery, too long) is replaced, never echoed.
    for bad in ("two words", "x\tINFO forged", "a" * 200):
        echoed = http.get("/health", headers={"X-Request-Id": bad}).headers["x-request-id"]
        assert echoed != bad and re.fullmatch(r"[0-9a-f]{32}", echoed)
    # Errors raised before any route runs carry one too.
    assert re.fullmatch(r"[0-9a-f]{32}", http.get("/nope").headers["x-request-id"])


# -- CORS and the bind address (settings and the middleware wiring, without a model) ---------------------------

def _cors_app(settings: Settings) -> TestClient:
    app = Starlette(routes=[Route("/v1/models", lambda _: PlainTextResponse("ok"), methods=["GET"])])
    add_outer_middleware(app, settings)
    return TestClient(app)


PREFLIGHT = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type"}


def test_cors_is_off_by_default() -> None:
    client = _cors_app(Settings())
    response = client.get("/v1/models", headers={"Origin": "https://app.example"})
    assert "access-control-allow-origin" not in response.headers
    assert "access-control-allow-origin" not in client.options("/v1/models", headers=PREFLIGHT).headers


def test_cors_allows_only_the_configured_origins() -> None:
    client = _cors_app(Settings(cors_allow_origin="https://app.example,https://other.example"))
    preflight = client.options("/v1/models", headers=PREFLIGHT)
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "https://app.example"
    response = client.get("/v1/models", headers={"Origin": "https://app.example"})
    assert response.headers["access-control-allow-origin"] == "https://app.example"
    assert "x-request-id" in response.headers["access-control-expose-headers"].lower()
    stranger = client.get("/v1/models", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in stranger.headers


def test_cors_origin_flag_repeats_and_host_defaults_to_loopback(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse

    from corral.server.cli import _serve_parser

    parser = argparse.ArgumentParser()
    _serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--cors-allow-origin", "https://a.example", "--cors-allow-origin",
                              "https://b.example", "--max-body-bytes", "1024"])
    settings = settings_from_args(args)
    assert settings.cors_origins() == ["https://a.example", "https://b.example"]
    assert settings.max_body_bytes == 1024
    assert settings.host == "127.0.0.1"
    monkeypatch.setenv("CORRAL_MAX_TOOLS", "7")
    monkeypatch.setenv("CORRAL_CORS_ALLOW_ORIGIN", "https://c.example")
    assert (Settings().max_tools, Settings().cors_origins()) == (7, ["https://c.example"])
    with pytest.raises(SystemExit):
        cli_main(["serve", "--help"])
    help_text = capsys.readouterr().out
    for flag in ("--max-body-bytes", "--max-json-depth", "--max-schema-depth", "--max-schema-nodes",
                 "--max-schema-refs", "--max-regex-length", "--max-grammar-length", "--max-choices", "--max-tools",
                 "--cors-allow-origin"):
        assert flag in help_text


def test_compile_log_lines_carry_the_request_id(http: httpx.Client, caplog: pytest.LogCaptureFixture) -> None:
    """Grammar compiles run on a worker thread; their log lines still name the request they compile for."""
    regex = f"a(b{uuid.uuid4().hex}"  # unique: a refusal is cached, and only the first compile logs it
    body = {**CHOICE_OK, "structured_outputs": {"regex": regex}}
    with caplog.at_level(logging.INFO, logger="corral.grammar_engines.compilation"):
        response = http.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "compile-trace-7"})
    assert response.status_code == 400
    refused = [r for r in caplog.records if r.name == "corral.grammar_engines.compilation" and regex in r.getMessage()]
    assert refused, [r.getMessage() for r in caplog.records]
    assert all(getattr(r, "request_id", None) == "compile-trace-7" for r in refused)


def test_exception_mid_stream_ends_with_an_error_event(
    http: httpx.Client, server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the 200 headers a status code is too late: the stream ends with an OpenAI-shaped error event,
    never a cut connection, and the connection then serves the next request."""

    def broken_finish(*_: Any) -> Any:
        raise RuntimeError("secret detail from inside the server")

    before = _internal_errors(http)
    monkeypatch.setattr(server.service, "finish", broken_finish)
    body = {**CHOICE_OK, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body, headers={"X-Request-Id": "stream-500"}) as response:
        assert response.status_code == 200
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
        port = local_port(response)
    monkeypatch.undo()
    assert events and events[0] != "[DONE]"
    last = json.loads(events[-1])
    assert set(last) == {"error"}, last
    assert (last["error"]["type"], last["error"]["code"]) == ("server_error", "internal_error")
    assert "stream-500" in last["error"]["message"] and "secret detail" not in last["error"]["message"]
    assert _internal_errors(http) == before + 1
    assert_serves_on(http, port)
