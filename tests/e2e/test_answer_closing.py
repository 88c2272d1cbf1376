"""Answers that close (corral/structured/answer_closing.py), over HTTP with the official SDK: a JSON Schema or
tool-call answer that max_tokens would cut ends with the grammar's shortest completion instead, valid under
the full schema, reported honestly (`finish_reason: length`, `corral_finish_reason: closed`,
`grammar.closed`), counted in a metric, and off when the request or the server says so."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import pytest
from conftest import RunningServer, serving

ORDER = {
    "type": "object",
    "properties": {
        "customer": {"type": "string"},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "qty": {"type": "integer"}},
                "required": ["name", "qty"],
            },
        },
        "total": {"type": "number"},
    },
    "required": ["customer", "items", "total"],
}
PROMPT = [{"role": "user", "content": "Ann Lee ordered 2 widgets and 1 gadget for 31.50. Give the order as JSON."}]


def _ask(server: RunningServer, max_tokens: int, **extra: Any) -> Any:
    client: Any = server.client()
    return client.chat.completions.create(
        model="corral-tiny",
        messages=PROMPT,
        response_format={"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER}},
        max_tokens=max_tokens,
        temperature=0,
        extra_body=extra,
    )


def _closed_count(server: RunningServer, why: str) -> float:
    for line in httpx.get(f"{server.base_url}/metrics").text.splitlines():
        if line.startswith(f'corral_closed_answers_total{{why="{why}"}}'):
            return float(line.split()[-1])
    return 0.0


@pytest.mark.parametrize("max_tokens", [16, 24, 32])
def test_a_cut_answer_closes_valid_and_says_so(server: RunningServer, max_tokens: int) -> None:
    before = _closed_count(server, "budget")
    resp = _ask(server, max_tokens)
    choice = resp.choices[0]
    extra = choice.model_extra
    assert choice.finish_reason == "length" and extra["corral_finish_reason"] == "closed", extra
    jsonschema.validate(json.loads(choice.message.content), ORDER)
    grammar = resp.model_extra["grammar"]
    assert grammar["closed"] == "budget" and grammar["valid"] is True
    assert resp.usage.completion_tokens <= max_tokens
    assert _closed_count(server, "budget") == before + 1


def test_the_request_can_turn_it_off(server: RunningServer) -> None:
    resp = _ask(server, 16, close_answers=False)
    choice = resp.choices[0]
    assert choice.model_extra["corral_finish_reason"] == "length"
    assert resp.model_extra["grammar"]["closed"] is None and resp.model_extra["grammar"]["valid"] is False


def test_an_answer_with_room_is_not_closed(server: RunningServer) -> None:
    resp = _ask(server, 512)
    assert resp.choices[0].model_extra["corral_finish_reason"] == "stop"
    assert resp.model_extra["grammar"]["closed"] is None


def test_the_server_can_turn_it_off() -> None:
    with serving(close_answers=False) as running:
        resp = _ask(running, 16)
        assert resp.choices[0].model_extra["corral_finish_reason"] == "length"
        assert _ask(running, 16, close_answers=True).choices[0].model_extra["corral_finish_reason"] == "closed"


def test_a_streamed_answer_closes_too(server: RunningServer) -> None:
    client: Any = server.client()
    stream = client.chat.completions.create(
        model="corral-tiny",
        messages=PROMPT,
        response_format={"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER}},
        max_tokens=24,
        temperature=0,
        stream=True,
    )
    text, last = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            last = chunk.choices[0]
    assert last is not None and last.finish_reason == "length"
    assert last.model_extra["corral_finish_reason"] == "closed"
    jsonschema.validate(json.loads(text), ORDER)


def test_a_cut_tool_call_closes_into_a_valid_call(server: RunningServer) -> None:
    client: Any = server.client()
    resp = client.chat.completions.create(
        model="corral-tiny",
        messages=[{"role": "user", "content": "Book it."}],
        tools=[{"type": "function", "function": {"name": "book", "parameters": ORDER}}],
        tool_choice="required",
        max_tokens=32,
        temperature=0,
    )
    choice = resp.choices[0]
    assert choice.model_extra["corral_finish_reason"] == "closed" and choice.finish_reason == "length"
    (call,) = choice.message.tool_calls
    assert call.function.name == "book"
    jsonschema.validate(json.loads(call.function.arguments), ORDER)


def _one_token(server: RunningServer, text: str) -> str:
    ids = server.service.loaded.tokenizer.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]
    assert len(ids) == 1, (text, ids)
    return str(ids[0])


@pytest.mark.parametrize(
    ("schema", "pushed", "shape"),
    [
        # A number growing without end (the base model wrote a 60-digit integer): closed past 20 digits.
        ({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}, ["777"], r"-?7{21,}"),
        # Digits inside a string count too (Gemma 3 wrote `"123456789012…"` ids until max_tokens).
        # (The pattern makes the string start with 7: the model's first pick is a token that opens it.)
        (
            {"type": "object", "properties": {"s": {"type": "string", "pattern": "^7"}}, "required": ["s"]},
            ["777"],
            r'"7{21,29}"',
        ),
        # One short item repeated: closed once the cycle spans the runaway window, not at max_tokens.
        (
            {
                "type": "object",
                "properties": {"xs": {"type": "array", "items": {"type": "integer"}}},
                "required": ["xs"],
                "additionalProperties": False,
            },
            ["7", ","],
            r"\[7(, -?7)+(, -?1)?\]",
        ),
    ],
)
def test_a_runaway_closes_long_before_the_budget(
    server: RunningServer, schema: dict[str, Any], pushed: list[str], shape: str
) -> None:
    client: Any = server.client()
    resp = client.chat.completions.create(
        model="corral-tiny",
        messages=[{"role": "user", "content": "go"}],
        response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}},
        max_tokens=400,
        temperature=0,
        logit_bias={_one_token(server, text): 100 for text in pushed},  # the model made to run away
    )
    choice = resp.choices[0]
    assert choice.model_extra["corral_finish_reason"] == "closed" and resp.model_extra["grammar"]["closed"] == "runaway"
    assert resp.usage.completion_tokens < 100
    value = json.loads(choice.message.content)
    jsonschema.validate(value, schema)
    assert re.fullmatch(shape, json.dumps(next(iter(value.values())))), choice.message.content
