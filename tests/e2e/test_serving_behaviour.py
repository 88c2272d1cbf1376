"""Serving behaviour users rely on: batching order, disconnects, 429, and /metrics."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import RunningServer

CHAT = [{"role": "user", "content": "hello"}]


def _wait_for(predicate: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError("condition not reached in time")


def test_short_request_after_long_one_finishes_first(server: RunningServer, client: Any) -> None:
    finished: list[str] = []

    def run(name: str, max_tokens: int) -> None:
        client.chat.completions.create(
            model="corral-tiny", messages=CHAT, max_tokens=max_tokens, extra_body={"ignore_eos": True}
        )
        finished.append(name)

    long = threading.Thread(target=run, args=("long", 600))
    long.start()
    service: Any = server.service
    _wait_for(lambda: len(service.engine.scheduler.running) >= 1)
    run("short", 4)
    long.join(timeout=120)
    assert finished == ["short", "long"]


def test_client_disconnect_mid_stream_frees_the_slot(server: RunningServer) -> None:
    service: Any = server.service
    body = {"model": "corral-tiny", "messages": CHAT, "max_tokens": 2000, "stream": True, "ignore_eos": True}
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", f"{server.base_url}/v1/chat/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        lines = resp.iter_lines()
        for _ in range(4):
            next(lines)
        assert len(service.engine.scheduler.running) == 1
    _wait_for(lambda: not service.engine.scheduler.running and service.in_flight == 0)
    metrics = httpx.get(f"{server.base_url}/metrics").text
    assert 'corral_requests_total{finish_reason="abort"}' in metrics


def test_full_queue_answers_429_and_then_serves_again(
    server: RunningServer, client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    service: Any = server.service
    monkeypatch.setattr(service.settings, "max_queue", 1)
    blocker = threading.Thread(
        target=lambda: client.chat.completions.create(
            model="corral-tiny", messages=CHAT, max_tokens=400, extra_body={"ignore_eos": True}
        )
    )
    blocker.start()
    _wait_for(lambda: service.in_flight == 1)
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(model="corral-tiny", messages=CHAT, max_tokens=4)
    assert info.value.status_code == 429
    assert info.value.body["code"] == "queue_full"  # type: ignore[index]
    blocker.join(timeout=120)
    ok = client.chat.completions.create(model="corral-tiny", messages=CHAT, max_tokens=4)
    assert ok.choices[0].finish_reason in ("stop", "length")


DOCUMENTED = [
    "corral_time_to_first_token_seconds",
    "corral_inter_token_latency_seconds",
    "corral_request_latency_seconds",
    "corral_request_queue_seconds",
    "corral_grammar_compile_seconds",
    "corral_grammar_cache_total",
    "corral_mask_fill_seconds",
    "corral_forced_tokens_total",
    "corral_generated_tokens_total",
    "corral_requests_total",
    "corral_failures_total",
    "corral_mode_outcomes_total",
    "corral_rejected_requests_total",
    "corral_running_requests",
    "corral_waiting_requests",
]


def _sample(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_metrics_expose_documented_names_and_move(server: RunningServer, client: Any) -> None:
    before = httpx.get(f"{server.base_url}/metrics").text
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    client.chat.completions.create(
        model="corral-tiny",
        messages=CHAT,
        max_tokens=50,
        extra_body={"structured_outputs": {"json": schema, "backend": "llguidance"}},
    )
    after = httpx.get(f"{server.base_url}/metrics").text
    documented = Path(server_docs()).read_text()
    for name in DOCUMENTED:
        assert f"# HELP {name}" in after, name
        assert name in documented, f"{name} missing from docs/metrics.md"
    assert _sample(after, "corral_requests_total") > _sample(before, "corral_requests_total")
    assert _sample(after, "corral_time_to_first_token_seconds_count") > _sample(
        before, "corral_time_to_first_token_seconds_count"
    )
    assert _sample(after, 'corral_mask_fill_seconds_count{backend="llguidance"}') > _sample(
        before, 'corral_mask_fill_seconds_count{backend="llguidance"}'
    )
    assert _sample(after, "corral_grammar_cache_total") > _sample(before, "corral_grammar_cache_total")


def test_outcomes_are_counted_by_the_mode_the_request_used(server: RunningServer, client: Any) -> None:
    """A mediating client's mode shows in the constraint it sends: a schema, a bare JSON object, or nothing."""
    modes = {
        "schema_constrained": {"response_format": {"type": "json_schema", "json_schema": {
            "name": "n", "schema": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}},
        "json_mode": {"response_format": {"type": "json_object"}},
        "contract_only": {},
    }
    for mode, fields in modes.items():
        key = f'corral_mode_outcomes_total{{mode="{mode}",'  # every outcome of this mode
        before = _sample(httpx.get(f"{server.base_url}/metrics").text, key)
        reply = client.chat.completions.create(model="corral-tiny", messages=CHAT, max_tokens=2, **fields)
        after = httpx.get(f"{server.base_url}/metrics").text
        assert _sample(after, key) == before + 1, mode
        outcome = reply.choices[0].corral_finish_reason  # type: ignore[attr-defined]
        assert _sample(after, f'{key}outcome="{outcome}"}}') >= 1, (mode, outcome)


def server_docs() -> str:
    from conftest import REPO

    return str(REPO / "docs" / "metrics.md")


def test_stream_reports_extras_in_last_chunk(server: RunningServer) -> None:
    body = {
        "model": "corral-tiny",
        "messages": CHAT,
        "max_tokens": 30,
        "stream": True,
        "structured_outputs": {"choice": ["alpha", "beta"]},
        "stream_options": {"include_usage": True},
    }
    chunks = []
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", f"{server.base_url}/v1/chat/completions", json=body) as resp,
    ):
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text in ("alpha", "beta")
    last = [c for c in chunks if c["choices"]][-1]
    assert last["choices"][0]["finish_reason"] == "stop"
    assert last["grammar"]["valid"] is True and "ttft_ms" in last["timings"]
    assert chunks[-1]["usage"]["completion_tokens"] >= 1
