"""The SDK's `parse` helper with pydantic models, and streaming with the same guarantees."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel

MODEL = "corral-tiny"
BACKENDS = ["xgrammar", "llguidance", "auto"]
MESSAGES: list[Any] = [{"role": "user", "content": "Describe a person."}]

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


class Address(BaseModel):
    city: str
    zip_code: str


class Person(BaseModel):
    name: str
    age: int
    role: Literal["admin", "user", "guest"]
    address: Address
    tags: list[str]


def _parse(client: openai.OpenAI) -> Any:
    # openai>=1.92 has chat.completions.parse; older releases only beta.chat.completions.parse.
    completions = client.chat.completions
    return completions.parse if hasattr(completions, "parse") else client.beta.chat.completions.parse


@pytest.mark.parametrize("backend", BACKENDS)
def test_parse_returns_the_pydantic_object(client: openai.OpenAI, backend: str) -> None:
    resp = _parse(client)(
        model=MODEL, messages=MESSAGES, response_format=Person, max_tokens=200, seed=0,
        extra_body={"structured_outputs": {"backend": backend}},
    )
    message = resp.choices[0].message
    assert resp.choices[0].finish_reason == "stop"
    assert message.refusal is None
    assert isinstance(message.parsed, Person)
    assert isinstance(message.parsed.address, Address)
    assert message.parsed == Person.model_validate_json(message.content or "")
    grammar = (resp.model_extra or {})["grammar"]
    assert grammar["schema_valid"] is True
    assert grammar["backend"] == backend or backend == "auto"


def test_stream_helper_gives_parsed_final_completion(client: openai.OpenAI) -> None:
    with client.chat.completions.stream(
        model=MODEL, messages=MESSAGES, response_format=Person, max_tokens=200, seed=1,
    ) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == "stop"
    assert isinstance(final.choices[0].message.parsed, Person)


def _collect(stream: Any) -> tuple[str, list[Any]]:
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def _assert_stream_tail(chunks: list[Any]) -> dict[str, Any]:
    with_choices = [c for c in chunks if c.choices]
    last = with_choices[-1]
    assert last.choices[0].finish_reason == "stop"
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    extra = last.model_extra or {}
    assert isinstance(extra.get("timings"), dict)
    grammar = extra.get("grammar")
    assert isinstance(grammar, dict)
    # The usage chunk comes after the last choice chunk, with no choices, as OpenAI sends it.
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens > 0
    assert usage_chunk.usage.total_tokens == usage_chunk.usage.prompt_tokens + usage_chunk.usage.completion_tokens
    return grammar


@pytest.mark.parametrize("backend", BACKENDS)
def test_stream_json_schema(client: openai.OpenAI, backend: str) -> None:
    kwargs: dict[str, Any] = {
        "model": MODEL, "messages": MESSAGES, "max_tokens": 200, "seed": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
        "extra_body": {"structured_outputs": {"backend": backend}},
    }
    text, chunks = _collect(client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs
    ))
    jsonschema.validate(json.loads(text), SCHEMA)
    assert chunks[0].choices[0].delta.role == "assistant"
    grammar = _assert_stream_tail(chunks)
    assert grammar["schema_valid"] is True
    assert grammar["backend"] == backend or backend == "auto"
    # Same request, not streamed: same text and token count.
    whole = client.chat.completions.create(**kwargs)
    assert whole.choices[0].message.content == text
    assert whole.usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_stream_regex(client: openai.OpenAI) -> None:
    pattern = r"(yes|no)-[0-9]{2}"
    text, chunks = _collect(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=60, seed=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"structured_outputs": {"regex": pattern}},
    ))
    assert re.fullmatch(pattern, text), text
    assert _assert_stream_tail(chunks)["valid"] is True


def test_stream_without_include_usage_sends_no_usage_chunk(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=60, seed=0, stream=True,
        extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}},
    ))
    assert all(c.choices for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) in ("alpha", "beta")
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stream_completions_endpoint(client: openai.OpenAI) -> None:
    pattern = r"[a-z]{1,4}@[a-z]{1,4}\.com"
    chunks = list(client.completions.create(
        model=MODEL, prompt="email:", max_tokens=60, seed=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"structured_outputs": {"regex": pattern}},
    ))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert re.fullmatch(pattern, text), text
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[-1].choices[0].finish_reason == "stop"
    assert isinstance((with_choices[-1].model_extra or {}).get("grammar"), dict)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
