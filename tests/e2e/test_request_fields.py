"""No silent ignoring: every request field is honoured, mapped, harmlessly ignored, or refused with a 400 naming
it (corral/server/openai/fields.py is the one list; docs/api.md shows it). vLLM's guided_* names map onto
structured_outputs; content and values corral would silently change or drop are refused."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from conftest import REPO, RunningServer
from test_bad_input import assert_still_serving, expect_400

from corral.server.openai.fields import FIELDS, Endpoint, Treatment, declared_fields, markdown_table
from corral.server.openai.protocol import ChatCompletionRequest, CompletionRequest

MODEL = "corral-tiny"
MESSAGES: list[Any] = [{"role": "user", "content": "hello"}]


def _chat(client: openai.OpenAI, **extra: Any) -> Any:
    extra.setdefault("max_tokens", 20)
    max_tokens = extra.pop("max_tokens")
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=max_tokens, extra_body=extra)


# -- the registry ------------------------------------------------------------------------------------------------

def test_request_models_declare_exactly_the_honoured_and_mapped_fields() -> None:
    assert set(ChatCompletionRequest.model_fields) == declared_fields(Endpoint.CHAT)
    assert set(CompletionRequest.model_fields) == declared_fields(Endpoint.COMPLETIONS)


def test_docs_list_exactly_the_registry() -> None:
    docs = (REPO / "docs" / "api.md").read_text(encoding="utf-8")
    assert markdown_table() in docs, "regenerate the table: python -m corral.server.openai.fields"
    table = docs[docs.index("## Every field"):]
    listed = {line.split("`")[1] for line in table.splitlines() if line.startswith("| `")}
    assert listed == {rule.name for rule in FIELDS}


def test_every_refusal_names_a_reason() -> None:
    for rule in FIELDS:
        assert rule.note, rule.name
        assert not rule.neutral or rule.treatment is Treatment.REFUSED, rule.name


# -- unknown and refused fields ---------------------------------------------------------------------------------

def test_unknown_field_is_a_400_naming_it(client: openai.OpenAI) -> None:
    error = expect_400(lambda: _chat(client, temprature=0.5))
    assert (error["param"], error["code"]) == ("temprature", "unknown_parameter")
    assert "corral does not implement" in error["message"]
    assert_still_serving(client)


@pytest.mark.parametrize(("field", "value"), [
    ("reasoning_effort", "high"), ("use_beam_search", True), ("min_tokens", 5), ("audio", {"voice": "x"}),
    ("modalities", ["text", "audio"]), ("stop_token_ids", [13]), ("best_of", 3), ("prediction", {"type": "x"}),
    ("functions", [{"name": "f"}]), ("chat_template", "{{ x }}"), ("skip_special_tokens", False),
])
def test_unimplemented_field_is_refused(client: openai.OpenAI, field: str, value: Any) -> None:
    error = expect_400(lambda: _chat(client, **{field: value}))
    assert (error["param"], error["code"]) == (field, "unsupported_parameter")
    assert f"{field}: corral does not implement" in error["message"]


@pytest.mark.parametrize(("field", "value"), [
    ("user", "u-1"), ("metadata", {"k": "v"}), ("store", True), ("service_tier", "auto"),
    ("prompt_cache_key", "abc"), ("safety_identifier", "s"), ("request_id", "r-1"),
    # Refused fields at the value corral uses anyway (vLLM clients send their defaults):
    ("skip_special_tokens", True), ("best_of", 1), ("use_beam_search", False), ("min_tokens", 0),
    ("stop_token_ids", []), ("add_generation_prompt", True), ("modalities", ["text"]), ("reasoning_effort", None),
])
def test_harmless_fields_are_accepted(client: openai.OpenAI, field: str, value: Any) -> None:
    resp = _chat(client, structured_outputs={"choice": ["a", "b"]}, **{field: value})
    assert resp.choices[0].message.content in ("a", "b")


def test_nested_stream_option_is_refused(client: openai.OpenAI) -> None:
    error = expect_400(lambda: _chat(client, stream=True, stream_options={"continuous_usage_stats": True}))
    assert error["param"] == "stream_options.continuous_usage_stats"


def test_completions_refuse_echo_and_chat_only_fields(client: openai.OpenAI) -> None:
    error = expect_400(lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=3, echo=True))
    assert error["param"] == "echo"
    error = expect_400(lambda: client.completions.create(
        model=MODEL, prompt="x", max_tokens=3, extra_body={"messages": MESSAGES}))
    assert error["param"] == "messages" and "chat requests" in error["message"]


# -- legacy guided_* fields ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("field", "value", "kind", "check"), [
    ("guided_choice", ["left", "right"], "choice", lambda text: text in ("left", "right")),
    ("guided_regex", "[0-9]{3}", "regex", lambda text: len(text) == 3 and text.isdigit()),
    ("guided_json", {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}, "json_schema",
     lambda text: isinstance(json.loads(text)["n"], int)),
    ("guided_json", '{"type": "array", "maxItems": 2}', "json_schema", lambda text: len(json.loads(text)) <= 2),
    ("guided_grammar", 'root ::= "ab" | "cd"', "ebnf", lambda text: text in ("ab", "cd")),
    ("guided_json_object", True, "json_object", lambda text: isinstance(json.loads(text), dict)),
])
def test_legacy_field_maps_onto_structured_outputs(client: openai.OpenAI, field: str, value: Any, kind: str,
                                                   check: Any) -> None:
    resp = _chat(client, max_tokens=60, **{field: value})
    text = resp.choices[0].message.content
    assert resp.choices[0].finish_reason == "stop", text
    assert check(text), text
    assert (resp.model_extra or {})["grammar"]["kind"] == kind


def test_legacy_backend_names_the_backend(client: openai.OpenAI) -> None:
    resp = _chat(client, guided_choice=["x", "y"], guided_decoding_backend="guidance")  # vLLM's llguidance
    assert (resp.model_extra or {})["grammar"]["backend"] == "llguidance"
    error = expect_400(lambda: _chat(client, guided_choice=["x"], guided_decoding_backend="outlines"))
    assert error["param"] == "guided_decoding_backend"
    error = expect_400(lambda: _chat(client, guided_choice=["x"], guided_decoding_backend="xgrammar",
                                     structured_outputs={"backend": "llguidance"}))
    assert error["param"] == "guided_decoding_backend" and "disagree" in error["message"]


@pytest.mark.parametrize("other", [
    {"structured_outputs": {"regex": "a"}},
    {"response_format": {"type": "json_object"}},
    {"guided_regex": "a"},
])
def test_legacy_field_with_another_constraint_is_two_constraints(client: openai.OpenAI, other: dict[str, Any]) -> None:
    error = expect_400(lambda: _chat(client, guided_choice=["a", "b"], **other))
    assert "exactly one constraint" in error["message"]
    assert "guided_choice" in error["message"]


def test_bad_legacy_value_names_the_legacy_field(client: openai.OpenAI) -> None:
    error = expect_400(lambda: _chat(client, guided_choice=[]))
    assert error["param"] == "guided_choice" and "empty" in error["message"]
    error = expect_400(lambda: _chat(client, guided_json={"type": 12}))
    assert error["param"] == "guided_json"


def test_guided_whitespace_pattern_is_refused(client: openai.OpenAI) -> None:
    error = expect_400(lambda: _chat(client, guided_json={"type": "object"}, guided_whitespace_pattern=r"[ ]?"))
    assert error["param"] == "guided_whitespace_pattern"


# -- content and values corral would otherwise change ----------------------------------------------------------

@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    {"type": "file", "file": {"file_id": "f"}},
])
def test_non_text_content_part_is_refused(client: openai.OpenAI, part: dict[str, Any]) -> None:
    messages: Any = [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}]
    error = expect_400(lambda: client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5))
    assert error["param"] == "messages[1].content[1]"
    assert part["type"] in error["message"] and "text only" in error["message"]


def test_unknown_message_field_is_refused(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "hi"},
                     {"role": "assistant", "content": "x", "function_call": {"name": "f", "arguments": "{}"}}]
    error = expect_400(lambda: client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5))
    assert error["param"] == "messages[1].function_call"
    resp = client.chat.completions.create(
        model=MODEL, max_tokens=20, messages=[{"role": "user", "content": "hi", "name": "ann"},
                                             {"role": "assistant", "content": "x", "refusal": None},
                                             {"role": "user", "content": "again"}])
    assert resp.choices[0].finish_reason == "stop"


def test_text_content_parts_are_read(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5)
    assert resp.usage is not None and resp.usage.prompt_tokens > 0


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_past_the_context_is_refused(client: openai.OpenAI, field: str) -> None:
    error = expect_400(lambda: client.chat.completions.create(model=MODEL, messages=MESSAGES, **{field: 10**9}))
    assert (error["param"], error["code"]) == (field, "context_length_exceeded")
    assert "room for" in error["message"]


def test_max_tokens_that_fits_and_the_default_are_served(client: openai.OpenAI, server: RunningServer) -> None:
    room = 4096 - 30
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=room,
                                          extra_body={"structured_outputs": {"choice": ["ok"]}})
    assert resp.choices[0].message.content == "ok"
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES)  # the server's default budget
    assert resp.choices[0].finish_reason == "stop"


def test_response_format_text_is_the_unconstrained_default(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20,
                                          response_format={"type": "text"})
    assert resp.choices[0].finish_reason == "stop"
    assert (resp.model_extra or {}).get("grammar") is None


# -- the default model answers free text -----------------------------------------------------------------------

@pytest.mark.parametrize(("temperature", "seed"), [(0.0, 0), (1.0, 1), (1.0, 2), (0.7, 3)])
def test_default_model_answers_a_short_run_of_words(client: openai.OpenAI, temperature: float, seed: int) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Hi {seed}"}],
                                          temperature=temperature, seed=seed, max_tokens=50)
    text = resp.choices[0].message.content or ""
    assert resp.choices[0].finish_reason == "stop", text
    assert resp.usage is not None and 3 <= resp.usage.completion_tokens <= 15, text
    assert len(text.split()) >= 3, text

