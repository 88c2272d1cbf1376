"""A grammar whose compile explodes is refused within the deadline over HTTP, the refusal is cached, and
ordinary requests keep being served meanwhile."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from conftest import RunningServer, serving

DEADLINE = 2.0
# 300 counted repetitions in a row: xgrammar compiles this for more than 30 s (auto tries xgrammar first
# for regexes).
HOSTILE_REGEX = "".join(f"[a-z]{{1,{i + 50}}}" for i in range(300))


@pytest.fixture(scope="module")
def strict_server() -> Iterator[RunningServer]:
    with serving(compile_timeout_s=DEADLINE) as running:
        yield running


def test_exploding_regex_is_refused_in_time_and_then_at_once(strict_server: RunningServer) -> None:
    client: Any = strict_server.client()
    ordinary: list[float] = []

    def keep_serving() -> None:
        for _ in range(3):
            t0 = time.monotonic()
            resp = client.chat.completions.create(
                model="corral-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=20,
                extra_body={"structured_outputs": {"choice": ["on", "off"]}})
            assert resp.choices[0].message.content in ("on", "off")
            ordinary.append(time.monotonic() - t0)

    other = threading.Thread(target=keep_serving)
    started = time.monotonic()
    other.start()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="corral-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=20,
            extra_body={"structured_outputs": {"regex": HOSTILE_REGEX}})
    first = time.monotonic() - started
    other.join(timeout=60)
    body: Any = info.value.body
    assert body["code"] == "grammar_compile_timeout"
    assert body["param"] == "structured_outputs.regex"
    assert first < DEADLINE + 3, f"refused after {first:.1f} s"
    assert len(ordinary) == 3 and max(ordinary) < 10

    t0 = time.monotonic()
    with pytest.raises(openai.BadRequestError) as again:
        client.chat.completions.create(
            model="corral-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=20,
            extra_body={"structured_outputs": {"regex": HOSTILE_REGEX}})
    assert again.value.body["code"] == "grammar_compile_timeout"  # type: ignore[index]
    second = time.monotonic() - t0
    assert second < 1.0  # the refusal was cached
    print(f"\ncompile_timeout: first refusal {first:.2f} s, cached refusal {second:.3f} s, "
          f"ordinary requests meanwhile max {max(ordinary):.2f} s")
    metrics = httpx.get(f"{strict_server.base_url}/metrics").text
    assert 'corral_watchdog_trips_total{kind="compile_timeout"} 2.0' in metrics
