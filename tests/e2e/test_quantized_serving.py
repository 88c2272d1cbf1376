"""A server started with --quantization serves with quantized weights: /v1/models says so and counts the
bytes a step reads, and constrained answers are still valid (corral-tiny; Gemma 3 in test_real_model.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from conftest import RunningServer, serving

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def int4_server() -> Iterator[RunningServer]:
    with serving(quantization="int4") as running:
        yield running


def test_models_reports_the_quantization_and_its_bytes(int4_server: RunningServer) -> None:
    model = httpx.get(f"{int4_server.base_url}/v1/models").json()["data"][0]
    assert model["quantization"] == "int4"
    # corral-tiny: a 128,257 x 64 head (int8 under int4: head_quantization) and 2 small layers (int4), where
    # float32 reads 4 bytes a weight.
    assert 0 < model["weight_bytes"] < 128_257 * 64 * 4 / 3.5


def test_a_constrained_answer_is_valid(int4_server: RunningServer) -> None:
    reply = httpx.post(
        f"{int4_server.base_url}/v1/chat/completions",
        json={
            "model": "corral-tiny",
            "messages": [{"role": "user", "content": "A person as JSON."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
            "max_tokens": 40,
            "temperature": 0,
        },
        timeout=60,
    ).json()
    answer = json.loads(reply["choices"][0]["message"]["content"])
    assert set(answer) == {"name", "age"} and isinstance(answer["age"], int)
    assert reply["grammar"]["valid"] is True
