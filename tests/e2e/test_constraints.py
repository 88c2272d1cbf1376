"""Every constraint kind, on every backend, through the official SDK against a real server."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import jsonschema
import openai
import pytest

MODEL = "corral-tiny"
BACKENDS = ["xgrammar", "llguidance", "auto"]
KNOWN_BACKENDS = {"xgrammar", "llguidance"}
MESSAGES: list[Any] = [{"role": "user", "content": "Answer in the requested shape."}]

PERSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}

CHOICES = ["red", "green", "blue"]
REGEXES = [r"(yes|no)-[0-9]{2}", r"[a-z]{1,4}@[a-z]{1,4}\.com"]
LARK_GRAMMAR = 'start: "id=" NUM\nNUM: /[0-9]{1,3}/\n'
LARK_EQUIVALENT = r"id=[0-9]{1,3}"
EBNF_GRAMMAR = 'root ::= answer "-" digit digit\nanswer ::= "yes" | "no"\ndigit ::= [0-9]\n'
EBNF_EQUIVALENT = r"(yes|no)-[0-9]{2}"


def grammar_extra(resp: Any) -> dict[str, Any]:
    extra = resp.model_extra or {}
    grammar = extra.get("grammar")
    assert isinstance(grammar, dict), f"response has no grammar extra: {extra}"
    return grammar


def assert_backend(grammar: dict[str, Any], requested: str) -> None:
    assert grammar["requested_backend"] == requested
    if requested == "auto":
        assert grammar["backend"] in KNOWN_BACKENDS
    else:
        assert grammar["backend"] == requested


def chat(client: openai.OpenAI, structured: dict[str, Any] | None = None, **kwargs: Any) -> Any:
    kwargs.setdefault("max_tokens", 200)
    kwargs.setdefault("seed", 0)
    extra_body = {"structured_outputs": structured} if structured is not None else None
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body=extra_body, **kwargs)


def finished_text(resp: Any) -> str:
    choice = resp.choices[0]
    assert choice.finish_reason == "stop", choice
    content = choice.message.content
    assert isinstance(content, str)
    return content


@pytest.mark.parametrize("backend", BACKENDS)
def test_json_schema_response_format(client: openai.OpenAI, backend: str) -> None:
    resp = chat(
        client,
        {"backend": backend},
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}},
    )
    value = json.loads(finished_text(resp))
    jsonschema.validate(value, PERSON_SCHEMA)
    grammar = grammar_extra(resp)
    assert_backend(grammar, backend)
    assert grammar["kind"] == "json_schema"
    assert grammar["schema_valid"] is True
    assert grammar["failure"] is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_json_schema_structured_outputs(client: openai.OpenAI, backend: str) -> None:
    schema = {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4}
    resp = chat(client, {"json": schema, "backend": backend})
    value = json.loads(finished_text(resp))
    jsonschema.validate(value, schema)
    assert_backend(grammar_extra(resp), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_json_object_response_format(client: openai.OpenAI, backend: str) -> None:
    resp = chat(client, {"backend": backend}, response_format={"type": "json_object"})
    value = json.loads(finished_text(resp))
    assert isinstance(value, dict)
    grammar = grammar_extra(resp)
    assert_backend(grammar, backend)
    assert grammar["kind"] == "json_object"
    assert grammar["schema_valid"] is True


@pytest.mark.parametrize("backend", BACKENDS)
def test_json_object_structured_outputs(client: openai.OpenAI, backend: str) -> None:
    resp = chat(client, {"json_object": True, "backend": backend}, seed=3)
    assert isinstance(json.loads(finished_text(resp)), dict)
    assert_backend(grammar_extra(resp), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_choice(client: openai.OpenAI, backend: str) -> None:
    for seed in range(3):
        resp = chat(client, {"choice": CHOICES, "backend": backend}, seed=seed)
        assert finished_text(resp) in CHOICES
        grammar = grammar_extra(resp)
        assert_backend(grammar, backend)
        assert grammar["kind"] == "choice"
        assert grammar["valid"] is True


@pytest.mark.parametrize("backend", BACKENDS)
def test_choice_with_characters_that_need_escaping(client: openai.OpenAI, backend: str) -> None:
    options = ['say "hi"', "back\\slash", "café", "two\nlines"]
    for seed in range(3):
        text = finished_text(chat(client, {"choice": options, "backend": backend}, seed=seed))
        assert text in options


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pattern", REGEXES)
def test_regex(client: openai.OpenAI, backend: str, pattern: str) -> None:
    resp = chat(client, {"regex": pattern, "backend": backend}, max_tokens=60)
    text = finished_text(resp)
    assert re.fullmatch(pattern, text), text
    grammar = grammar_extra(resp)
    assert_backend(grammar, backend)
    assert grammar["kind"] == "regex"
    assert grammar["valid"] is True


@pytest.mark.parametrize("backend", BACKENDS)
def test_lark_grammar(client: openai.OpenAI, backend: str) -> None:
    resp = chat(client, {"grammar": LARK_GRAMMAR, "backend": backend}, max_tokens=60)
    text = finished_text(resp)
    assert re.fullmatch(LARK_EQUIVALENT, text), text
    grammar = grammar_extra(resp)
    assert_backend(grammar, backend)
    assert grammar["kind"] == "lark"


@pytest.mark.parametrize("backend", BACKENDS)
def test_ebnf_grammar(client: openai.OpenAI, backend: str) -> None:
    resp = chat(client, {"grammar": EBNF_GRAMMAR, "backend": backend}, max_tokens=60)
    text = finished_text(resp)
    assert re.fullmatch(EBNF_EQUIVALENT, text), text
    grammar = grammar_extra(resp)
    assert_backend(grammar, backend)
    assert grammar["kind"] == "ebnf"


@pytest.mark.parametrize(("syntax", "grammar_text", "equivalent"), [
    ("lark", LARK_GRAMMAR, LARK_EQUIVALENT),
    ("ebnf", EBNF_GRAMMAR, EBNF_EQUIVALENT),
])
def test_declared_grammar_syntax(client: openai.OpenAI, syntax: str, grammar_text: str, equivalent: str) -> None:
    resp = chat(client, {"grammar": grammar_text, "grammar_syntax": syntax}, max_tokens=60)
    assert re.fullmatch(equivalent, finished_text(resp))
    assert grammar_extra(resp)["kind"] == syntax


def test_string_length_bounds_route_to_llguidance(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"code": {"type": "string", "minLength": 2, "maxLength": 5}},
        "required": ["code"],
        "additionalProperties": False,
    }
    resp = chat(client, {"json": schema, "backend": "auto"})
    value = json.loads(finished_text(resp))
    jsonschema.validate(value, schema)
    assert grammar_extra(resp)["backend"] == "llguidance"


def test_length_limit_reports_length_not_stop(client: openai.OpenAI) -> None:
    resp = chat(client, {"json": PERSON_SCHEMA}, max_tokens=3)
    assert resp.choices[0].finish_reason == "length"
    grammar = grammar_extra(resp)
    assert grammar["schema_valid"] is False
    assert grammar["failure"] == "length"


@pytest.mark.parametrize("backend", BACKENDS)
def test_completions_endpoint_regex(client: openai.OpenAI, backend: str) -> None:
    pattern = REGEXES[0]
    resp = client.completions.create(
        model=MODEL, prompt="The answer:", max_tokens=60, seed=0,
        extra_body={"structured_outputs": {"regex": pattern, "backend": backend}},
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"
    assert re.fullmatch(pattern, choice.text), choice.text
    assert_backend(grammar_extra(resp), backend)


def test_completions_endpoint_json_schema(client: openai.OpenAI) -> None:
    resp = client.completions.create(
        model=MODEL, prompt="A person as JSON:", max_tokens=200, seed=0,
        extra_body={"structured_outputs": {"json": PERSON_SCHEMA}},
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.text), PERSON_SCHEMA)
    assert grammar_extra(resp)["schema_valid"] is True


@pytest.mark.parametrize("backend", BACKENDS)
def test_second_identical_request_is_a_cache_hit(client: openai.OpenAI, backend: str) -> None:
    # A pattern no other test uses, so the first request is certainly a miss.
    pattern = f"(tag{uuid.uuid4().hex[:8]}|other)-[0-9]"
    first = chat(client, {"regex": pattern, "backend": backend}, max_tokens=60)
    second = chat(client, {"regex": pattern, "backend": backend}, max_tokens=60)
    assert grammar_extra(first)["cache_hit"] is False
    assert grammar_extra(second)["cache_hit"] is True
    assert grammar_extra(second)["backend"] == grammar_extra(first)["backend"]
    assert re.fullmatch(pattern, finished_text(second))


@pytest.mark.parametrize("backend", BACKENDS)
def test_properties_are_generated_in_declared_order(client: openai.OpenAI, backend: str) -> None:
    # Callers rely on declared order (e.g. "reasoning" before "answer"), as OpenAI and vLLM honour it.
    schema = {
        "type": "object",
        "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "boolean"}},
        "required": ["zeta", "alpha"],
        "additionalProperties": False,
    }
    resp = chat(client, {"json": schema, "backend": backend})
    pairs = json.loads(finished_text(resp), object_pairs_hook=list)
    assert [key for key, _ in pairs] == ["zeta", "alpha"]


def test_unconstrained_request_has_no_grammar_extra(client: openai.OpenAI) -> None:
    resp = chat(client, max_tokens=5)
    extra = resp.model_extra or {}
    assert extra.get("grammar") is None
    assert isinstance(extra.get("timings"), dict)


def test_auto_backtracks_out_of_an_answer_only_the_full_schema_rejects(client: openai.OpenAI, server: Any) -> None:
    """xgrammar relaxes oneOf to anyOf, so "1" (matching both branches) gets through its grammar. Named
    explicitly, xgrammar answers it and the full-contract check calls it invalid_output. Under `auto`,
    llguidance refuses this oneOf, so its decode-safe profile (oneOf as anyOf too) serves it behind the
    contract guard: the guard refuses to end after "1", the engine backtracks and the answer is "2"."""
    schema = {"oneOf": [{"const": 1}, {"enum": [1, 2]}]}
    loaded = server.service.loaded
    one = loaded.tokenizer.encode("1", add_special_tokens=False)[0]
    bias = {str(one): 100, str(loaded.revision_token_id): -100}  # push toward "1"; no sampled revisions
    raw = chat(client, {"json": schema, "backend": "xgrammar"}, logit_bias=bias)
    assert raw.choices[0].message.content == "1"
    assert raw.choices[0].finish_reason == "content_filter"  # OpenAI's enum: the SDK's parse raises on it
    assert (raw.choices[0].model_extra or {})["corral_finish_reason"] == "invalid_output"
    assert grammar_extra(raw)["schema_valid"] is False
    guarded = chat(client, {"json": schema, "backend": "auto"}, logit_bias=bias)
    assert finished_text(guarded) == "2"
    grammar = grammar_extra(guarded)
    assert (grammar["backend"], grammar["profile"]) == ("llguidance", "decode_safe")
    assert grammar["schema_valid"] is True
    assert grammar["revisions"] >= 1  # the dead end after "1" was backed out of


def test_auto_serves_a_keyword_no_engine_enforces(client: openai.OpenAI) -> None:
    """`not` is refused by both engines by name; `auto` compiles the decode-safe profile and the contract
    guard enforces `not` where the answer ends, so the answer satisfies the whole schema."""
    schema = {"type": "array", "items": {"type": "integer"}, "maxItems": 3, "not": {"maxItems": 0}}
    for seed in range(3):
        resp = chat(client, {"json": schema, "backend": "auto"}, seed=seed, temperature=0.8)
        value = json.loads(finished_text(resp))
        jsonschema.validate(value, schema)  # in particular: not the empty array
        grammar = grammar_extra(resp)
        assert (grammar["profile"], grammar["schema_valid"]) == ("decode_safe", True)


def test_streamed_answer_never_shows_what_the_guard_backed_out_of(client: openai.OpenAI, server: Any) -> None:
    """Streaming sends only text no remaining revision could retract, so the "1" the guard refuses to end
    on is never sent; the stream is exactly the final answer."""
    loaded = server.service.loaded
    one = loaded.tokenizer.encode("1", add_special_tokens=False)[0]
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=20, stream=True,
        logit_bias={str(one): 100, str(loaded.revision_token_id): -100},
        extra_body={"structured_outputs": {"json": {"oneOf": [{"const": 1}, {"enum": [1, 2]}]}}},
    )
    deltas, reasons, extras = [], [], []
    for chunk in stream:
        for choice in chunk.choices:
            deltas.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
            extras.append((choice.model_extra or {}).get("grammar") or (chunk.model_extra or {}).get("grammar"))
    assert "".join(deltas) == "2"
    assert reasons[-1] == "stop"
    grammar = next(e for e in reversed(extras) if e)
    assert grammar["revisions"] >= 1 and grammar["schema_valid"] is True
