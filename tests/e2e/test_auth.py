"""API keys: with keys configured, /v1/* needs `Authorization: Bearer <key>` (401 in OpenAI's shape without),
/health stays open, /metrics is open unless --metrics-require-key."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from conftest import RunningServer, serving
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from corral.server.auth import ApiKeyMiddleware
from corral.server.cli import main, settings_from_args
from corral.server.settings import Settings

KEYS = ("key-one", "key-two")
MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def keyed_server() -> Iterator[RunningServer]:
    with serving(api_key=",".join(KEYS)) as running:
        yield running


def _client(server: RunningServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)


def _assert_401(exc: openai.AuthenticationError) -> None:
    assert exc.status_code == 401
    error = exc.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "invalid_api_key"


def test_wrong_key_is_a_401(keyed_server: RunningServer) -> None:
    client = _client(keyed_server, "wrong-key")
    with pytest.raises(openai.AuthenticationError) as info:
        client.chat.completions.create(model="corral-tiny", messages=MESSAGES, max_tokens=5)
    _assert_401(info.value)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_no_authorization_header_is_a_401(keyed_server: RunningServer) -> None:
    resp = httpx.post(f"{keyed_server.base_url}/v1/chat/completions", json={"messages": MESSAGES})
    assert resp.status_code == 401
    assert resp.json()["error"]["code"] == "invalid_api_key"
    assert "Bearer" in resp.json()["error"]["message"]


@pytest.mark.parametrize("key", KEYS)
def test_each_configured_key_is_served(keyed_server: RunningServer, key: str) -> None:
    client = _client(keyed_server, key)
    resp = client.chat.completions.create(model="corral-tiny", messages=MESSAGES, max_tokens=20,
                                          extra_body={"structured_outputs": {"choice": ["in", "out"]}})
    assert resp.choices[0].message.content in ("in", "out")
    with client.chat.completions.stream(model="corral-tiny", messages=MESSAGES, max_tokens=20) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == "stop"


def test_health_and_metrics_stay_open(keyed_server: RunningServer) -> None:
    assert httpx.get(f"{keyed_server.base_url}/health").status_code == 200
    assert httpx.get(f"{keyed_server.base_url}/metrics").status_code == 200


def test_open_server_ignores_the_header(server: RunningServer) -> None:
    resp = httpx.get(f"{server.base_url}/v1/models", headers={"Authorization": "Bearer anything"})
    assert resp.status_code == 200


def _app(protect_metrics: bool) -> TestClient:
    async def ok(_: Any) -> PlainTextResponse:
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/metrics", ok), Route("/health", ok), Route("/v1/models", ok)])
    return TestClient(ApiKeyMiddleware(app, KEYS, protect_metrics=protect_metrics))


def test_metrics_require_key_protects_metrics_only_when_asked() -> None:
    keyed = _app(protect_metrics=True)
    assert keyed.get("/metrics").status_code == 401
    assert keyed.get("/metrics", headers={"Authorization": f"Bearer {KEYS[1]}"}).status_code == 200
    assert keyed.get("/health").status_code == 200
    assert _app(protect_metrics=False).get("/metrics").status_code == 200
    assert keyed.get("/v1/models", headers={"Authorization": f"Basic {KEYS[0]}"}).status_code == 401


def test_keys_from_repeated_flags_and_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Settings] = []
    monkeypatch.setattr("corral.server.cli.serve", lambda args: seen.append(settings_from_args(args)) or 0)
    main(["serve", "--api-key", "a", "--api-key", "b", "--finish-reasons", "precise"])
    assert seen[0].api_keys() == {"a", "b"} and seen[0].finish_reasons == "precise"
    monkeypatch.setenv("CORRAL_API_KEY", "c, d")
    assert Settings().api_keys() == {"c", "d"}
    monkeypatch.setenv("CORRAL_FINISH_REASONS", "precise")
    assert Settings().finish_reasons == "precise"
