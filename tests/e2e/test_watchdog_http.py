"""Watchdog trips and revisions as an OpenAI SDK user sees them, next to ordinary requests."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
from conftest import RunningServer

CHAT = [{"role": "user", "content": "hello"}]


def _trips(base: str, kind: str) -> float:
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith(f'corral_watchdog_trips_total{{kind="{kind}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_whitespace_loop_under_a_regex_is_cut_short(server: RunningServer, client: Any) -> None:
    service: Any = server.service
    space = service.loaded.tokenizer.encode(" ", add_special_tokens=False)[0]
    before = _trips(server.base_url, "stall")
    ordinary: dict[str, Any] = {}

    def run_ordinary() -> None:
        ordinary["resp"] = client.chat.completions.create(
            model="corral-tiny",
            messages=CHAT,
            max_tokens=40,
            extra_body={"structured_outputs": {"choice": ["red", "green"]}},
        )

    other = threading.Thread(target=run_ordinary)
    started = time.monotonic()
    other.start()
    resp = client.chat.completions.create(
        model="corral-tiny",
        messages=CHAT,
        max_tokens=3000,
        logit_bias={str(space): 100},
        extra_body={"structured_outputs": {"regex": "[ ]*x"}},
    )
    elapsed = time.monotonic() - started
    other.join(timeout=60)
    choice = resp.choices[0]
    assert choice.finish_reason == "length"  # OpenAI's enum; the precise reason beside it
    assert (choice.model_extra or {})["corral_finish_reason"] == "stall"
    assert resp.usage.completion_tokens == 64  # the default whitespace limit, not the 3000-token budget
    assert resp.model_extra["grammar"]["watchdog"] == "stall"
    assert resp.model_extra["grammar"]["schema_valid"] is None and resp.model_extra["grammar"]["valid"] is False
    assert ordinary["resp"].choices[0].message.content in ("red", "green")
    assert elapsed < 60
    print(f"\nstall: answered in {elapsed:.2f} s (64 tokens of a 3000-token budget)")
    assert _trips(server.base_url, "stall") == before + 1


def test_revisions_over_http_stream_only_final_text(server: RunningServer, client: Any) -> None:
    service: Any = server.service
    revise = service.loaded.revision_token_id
    body = {
        "model": "corral-tiny",
        "messages": CHAT,
        "max_tokens": 20,
        "temperature": 0,
        "seed": 3,
        "logit_bias": {str(revise): 100},
        "max_revisions": 2,
        "ignore_eos": True,
    }
    whole = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60).json()
    assert whole["choices"][0]["finish_reason"] == "length"
    assert whole["choices"][0]["corral_finish_reason"] == "revision_depth_exceeded"
    stream = client.chat.completions.create(
        stream=True,
        **{k: v for k, v in body.items() if k not in ("max_revisions", "ignore_eos")},
        extra_body={"max_revisions": 2, "ignore_eos": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    last = [c for c in chunks if c.choices][-1]
    assert last.choices[0].finish_reason == "length"
    assert (last.choices[0].model_extra or {})["corral_finish_reason"] == "revision_depth_exceeded"
    assert last.model_extra["grammar"]["revisions"] == 2
    assert whole["grammar"]["watchdog"] == "revision_depth_exceeded"
    assert text == whole["choices"][0]["message"]["content"]
