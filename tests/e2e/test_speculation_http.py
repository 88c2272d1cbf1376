"""Speculative decoding over HTTP with the official SDK (docs/speculation.md): the request field `drafts`, the
`timings` and `/metrics` counts, the server's `--draft-tokens`; an answer is the same with drafts and without."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import RunningServer, serving
from test_bad_input import expect_400

from corral.server.engine.step_cost import CostParts

MODEL = "corral-tiny"
# Repeating text: lookups find continuations (the tiny model's greedy answers loop as well).
PROMPT = "name: Ada Lovelace, city: London, year: 1843. " * 6
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string", "minLength": 12, "maxLength": 30}, "city": {"type": "string"}},
    "required": ["name", "city"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def drafting() -> Iterator[RunningServer]:
    with serving(model=MODEL, draft_tokens=8) as running:
        # The tiny model's steps are too cheap to time reliably: drafting always pays here.
        running.service.engine.speculation.cost.parts = lambda: CostParts(10.0, 0.1, 0.1, 0.0, 0.1, guess_share=0.01)  # type: ignore[attr-defined]
        yield running


def _complete(server: RunningServer, **extra: Any) -> Any:
    """A completion of the repeating prompt as it is (no chat template), run to max_tokens (the tiny model's first
    pick is its end of text): its greedy answer loops, and lookups find what it repeats."""
    client: Any = server.client()
    return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True, **extra})


@pytest.mark.parametrize("constraint", [{}, {"structured_outputs": {"json": SCHEMA}}], ids=["free", "json_schema"])
def test_an_answer_is_the_same_with_drafts_and_without_and_timings_count_them(
    drafting: RunningServer, constraint: dict[str, Any]
) -> None:
    on = _complete(drafting, **constraint, drafts=True)
    off = _complete(drafting, **constraint, drafts=False)
    assert on.choices[0].text == off.choices[0].text
    assert on.choices[0].finish_reason == off.choices[0].finish_reason
    on_timings, off_timings = on.model_extra["timings"], off.model_extra["timings"]
    assert off_timings["draft_tokens"] == off_timings["draft_accepted"] == off_timings["drafts"] == 0
    assert on_timings["draft_tokens"] > 0 and on_timings["drafts"] > 0
    assert 0 <= on_timings["draft_accepted"] <= on_timings["draft_tokens"]
    assert on_timings["forward_steps"] <= off_timings["forward_steps"]


def test_metrics_count_drafted_and_accepted_tokens(drafting: RunningServer) -> None:
    _complete(drafting, drafts=True)
    text = httpx.get(f"{drafting.base_url}/metrics", timeout=10).text
    fed = re.search(r"^corral_draft_tokens_total (\S+)$", text, re.M)
    kept = re.search(r"^corral_draft_accepted_tokens_total (\S+)$", text, re.M)
    assert fed is not None and kept is not None
    assert float(fed.group(1)) > 0 and 0 <= float(kept.group(1)) <= float(fed.group(1))


def test_the_responses_api_takes_the_field(drafting: RunningServer) -> None:
    client: Any = drafting.client()
    answer = client.responses.create(model=MODEL, input=PROMPT, max_output_tokens=24, temperature=0,
                                     extra_body={"drafts": False})
    assert answer.status in ("completed", "incomplete")


def test_a_drafts_value_that_is_no_boolean_is_a_400_naming_it(drafting: RunningServer) -> None:
    client: Any = drafting.client()
    error = expect_400(lambda: client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, extra_body={"drafts": "sometimes"}))
    assert error["param"] == "drafts"


def test_a_server_started_with_no_draft_tokens_never_drafts() -> None:
    with serving(model=MODEL, draft_tokens=0) as plain:
        plain.service.engine.speculation.cost.parts = lambda: CostParts(10.0, 0.1, 0.1, 0.0, 0.1, guess_share=0.01)  # type: ignore[attr-defined]
        timings = _complete(plain, drafts=True).model_extra["timings"]
    assert timings["draft_tokens"] == 0 and timings["drafts"] == 0

