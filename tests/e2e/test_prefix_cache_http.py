"""Prefix caching seen from outside: a repeated system prompt moves the documented hit counter, answers stay."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from conftest import REPO, RunningServer

SYSTEM = "You are a helpful assistant. Answer with one short JSON object and nothing else. " * 4
NAMES = ("corral_prefix_cache_queried_tokens_total", "corral_prefix_cache_hit_tokens_total")


def _value(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " "))


def test_repeated_system_prompt_hits_the_prefix_cache(server: RunningServer, client: Any) -> None:
    before = httpx.get(f"{server.base_url}/metrics").text
    answers = []
    for question in ("first", "second", "first"):
        response = client.chat.completions.create(
            model="corral-tiny",
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            max_tokens=8,
            temperature=0,
        )
        answers.append(response.choices[0].message.content)
    after = httpx.get(f"{server.base_url}/metrics").text
    documented = Path(REPO / "docs" / "metrics.md").read_text()
    for name in (*NAMES, "corral_prefix_cache_host_bytes"):
        assert f"# HELP {name}" in after and name in documented, name
    queried = _value(after, NAMES[0]) - _value(before, NAMES[0])
    hits = _value(after, NAMES[1]) - _value(before, NAMES[1])
    assert queried > 0
    assert hits >= 2 * 48, (hits, queried)  # the second and third requests reuse at least the system prompt
    assert answers[0] == answers[2]  # a cached prefix does not change a greedy answer
