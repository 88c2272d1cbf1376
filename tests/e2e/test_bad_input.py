"""Bad input is a 400 in OpenAI's error shape that names what is wrong and where; the server keeps serving."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import openai
import pytest

MODEL = "corral-tiny"
BACKENDS = ["xgrammar", "llguidance", "auto"]
AUTO_JSON_ATTEMPTS = ["llguidance", "llguidance (decode-safe)", "xgrammar", "xgrammar (decode-safe)"]
MESSAGES: list[Any] = [{"role": "user", "content": "hello"}]
LINE_ONLY = re.compile(r"at line \d+")
LINE_COLUMN = re.compile(r"line \d+, column \d+|\b\d+:\d+\b|\b\d+\(\d+\)")


def expect_400(call: Callable[[], Any]) -> dict[str, Any]:
    """Run `call`, require a 400 in OpenAI's exact error shape, and return the inner error object."""
    with pytest.raises(openai.BadRequestError) as info:
        call()
    exc = info.value
    assert exc.status_code == 400
    body = exc.response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == "invalid_request_error"
    assert isinstance(error["message"], str) and error["message"]
    return dict(error)


def assert_still_serving(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=20, seed=0,
        extra_body={"structured_outputs": {"choice": ["fine", "good"]}},
    )
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].message.content in ("fine", "good")


def chat(client: openai.OpenAI, structured: dict[str, Any] | None = None, **kwargs: Any) -> Callable[[], Any]:
    kwargs.setdefault("max_tokens", 20)
    kwargs.setdefault("messages", MESSAGES)
    extra_body = {"structured_outputs": structured} if structured is not None else None

    def call() -> Any:
        return client.chat.completions.create(model=MODEL, extra_body=extra_body, **kwargs)

    return call


def schema_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "shape", "schema": schema}}


# -- invalid constraints --------------------------------------------------------------------------

def test_invalid_json_schema_names_the_pointer(client: openai.OpenAI) -> None:
    bad = {"type": "object", "properties": {"a": {"type": 12}}}
    error = expect_400(chat(client, response_format=schema_format(bad)))
    assert error["param"] == "response_format.json_schema.schema"
    assert "/properties/a/type" in error["message"]
    assert_still_serving(client)


def test_invalid_json_schema_in_structured_outputs(client: openai.OpenAI) -> None:
    bad = {"type": "array", "minItems": -1}
    error = expect_400(chat(client, {"json": bad}))
    assert error["param"] == "structured_outputs.json"
    assert "/minItems" in error["message"]
    assert_still_serving(client)


def test_schema_that_is_not_json(client: openai.OpenAI) -> None:
    error = expect_400(chat(client, {"json": '{"type": "object",'}))
    assert error["param"] == "structured_outputs.json"
    assert "not valid JSON" in error["message"]
    assert_still_serving(client)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unresolvable_ref_is_refused_by_every_backend(client: openai.OpenAI, backend: str) -> None:
    schema = {"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}, "required": ["x"]}
    error = expect_400(chat(client, {"backend": backend}, response_format=schema_format(schema)))
    assert str(error["param"]).startswith("response_format")
    assert error["code"] == "unsupported_schema"
    message = error["message"]
    assert "$defs/missing" in message
    # auto's JSON order: each engine's full compile, then its decode-safe profile.
    tried = AUTO_JSON_ATTEMPTS if backend == "auto" else [backend]
    assert f"tried {', '.join(tried)}" in message, message
    assert_still_serving(client)


@pytest.mark.parametrize(("keyword", "schema", "backend"), [
    ("not", {"not": {"type": "string"}}, "llguidance"),
    ("contains", {"type": "array", "contains": {"type": "integer"}}, "llguidance"),
    ("contains", {"type": "array", "contains": {"type": "integer"}}, "xgrammar"),
    ("not", {"not": {"type": "string"}}, "xgrammar"),
])
def test_keyword_the_named_backend_cannot_enforce(client: openai.OpenAI, keyword: str, schema: Any,
                                                  backend: str) -> None:
    """A schema the named backend cannot enforce is refused up front, never answered unconstrained
    (`auto` serves these through its decode-safe profile and the contract guard instead)."""
    error = expect_400(chat(client, {"json": schema, "backend": backend}))
    assert error["code"] == "unsupported_schema"
    message = error["message"]
    assert keyword in message
    assert f"tried {backend}" in message, message
    assert_still_serving(client)


@pytest.mark.parametrize("backend", BACKENDS)
def test_malformed_regex(client: openai.OpenAI, backend: str) -> None:
    error = expect_400(chat(client, {"regex": "a(b", "backend": backend}))
    assert error["param"] == "structured_outputs.regex"
    assert error["code"] == "invalid_grammar"
    assert "regex" in error["message"]
    assert "position" in error["message"] or "^" in error["message"]
    assert_still_serving(client)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lark_grammar_that_does_not_parse(client: openai.OpenAI, backend: str) -> None:
    error = expect_400(chat(client, {"grammar": 'start: "a" (\n', "backend": backend}))
    assert error["param"] == "structured_outputs.grammar"
    assert error["code"] == "invalid_grammar"
    assert "Lark" in error["message"]
    assert LINE_COLUMN.search(error["message"]), error["message"]
    assert_still_serving(client)



@pytest.mark.parametrize(("backend", "grammar"), [
    ("xgrammar", 'root ::= "a" (\n'),
    ("llguidance", 'root ::= "b" (\n'),
    ("auto", 'root ::= "c" (\n'),
    ("xgrammar", "root ::= undefined_rule\n"),
    ("llguidance", "root ::= undefined_rule_b\n"),
])
def test_ebnf_grammar_that_does_not_parse(client: openai.OpenAI, backend: str, grammar: str) -> None:
    error = expect_400(chat(client, {"grammar": grammar, "backend": backend}))
    assert error["param"] == "structured_outputs.grammar"
    assert error["code"] == "invalid_grammar"
    assert "EBNF" in error["message"]
    # llguidance's GBNF converter gives the line, or names the missing rule; the others give line:column.
    if backend == "llguidance":
        assert LINE_ONLY.search(error["message"]) or "undefined_rule_b" in error["message"], error["message"]
    else:
        assert LINE_COLUMN.search(error["message"]), error["message"]
    assert_still_serving(client)


# -- request shape ---------------------------------------------------------------------------------

def test_two_constraints_response_format_and_structured_outputs(client: openai.OpenAI) -> None:
    error = expect_400(chat(client, {"choice": ["a", "b"]}, response_format=schema_format({"type": "string"})))
    assert error["param"] == "structured_outputs.choice"
    assert "exactly one constraint" in error["message"]
    assert "response_format" in error["message"]
    assert_still_serving(client)


def test_two_constraints_inside_structured_outputs(client: openai.OpenAI) -> None:
    error = expect_400(chat(client, {"choice": ["a", "b"], "regex": "[ab]"}))
    assert error["param"] == "structured_outputs.regex"
    assert "exactly one constraint" in error["message"]
    assert "structured_outputs.choice" in error["message"]
    assert_still_serving(client)


def test_empty_choice(client: openai.OpenAI) -> None:
    error = expect_400(chat(client, {"choice": []}))
    assert error["param"] == "structured_outputs.choice"
    assert "empty" in error["message"]
    assert_still_serving(client)


def test_choice_that_is_not_a_list_of_strings(client: openai.OpenAI) -> None:
    error = expect_400(chat(client, {"choice": ["a", 3]}))
    assert error["param"] == "structured_outputs.choice"
    assert "list of strings" in error["message"]
    assert_still_serving(client)


def test_unknown_backend(client: openai.OpenAI) -> None:
    error = expect_400(chat(client, {"choice": ["a", "b"], "backend": "outlines-nope"}))
    assert error["param"] == "structured_outputs.backend"
    assert "outlines-nope" in error["message"]
    assert all(name in error["message"] for name in ("auto", "xgrammar", "llguidance"))
    assert_still_serving(client)


def test_unknown_structured_outputs_field(client: openai.OpenAI) -> None:
    error = expect_400(chat(client, {"jsonschema": {"type": "string"}}))
    assert error["param"] == "structured_outputs"
    assert "jsonschema" in error["message"]
    assert_still_serving(client)


def test_unknown_response_format_type(client: openai.OpenAI) -> None:
    error = expect_400(chat(client, response_format={"type": "xml"}))
    assert error["param"] == "response_format.type"
    assert "xml" in error["message"]
    assert_still_serving(client)


def test_prompt_longer_than_context(client: openai.OpenAI) -> None:
    long_message = " ".join(["word"] * 20_000)
    error = expect_400(chat(client, {"choice": ["a"]}, messages=[{"role": "user", "content": long_message}]))
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == "messages"
    assert "4096" in error["message"]
    assert_still_serving(client)


def test_completion_prompt_longer_than_context(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=" ".join(["word"] * 20_000), max_tokens=5)
    assert info.value.code == "context_length_exceeded"
    assert info.value.param == "prompt"
    assert_still_serving(client)


@pytest.mark.parametrize(("field", "value", "words"), [
    ("temperature", "hot", "number"),
    ("temperature", 5, "less than or equal"),
    ("top_p", 0, "greater than"),
    ("max_tokens", 0, "greater than or equal"),
    ("n", 17, "less than or equal"),
    ("seed", "abc", "integer"),
])
def test_malformed_body_field(client: openai.OpenAI, field: str, value: Any, words: str) -> None:
    error = expect_400(_raw(client, {field: value}))
    assert error["param"] == field
    assert field in error["message"] and words in error["message"], error["message"]
    assert_still_serving(client)


def _raw(client: openai.OpenAI, fields: dict[str, Any]) -> Callable[[], Any]:
    def call() -> Any:
        return client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=20, extra_body=fields,
        )

    return call


def test_missing_messages(client: openai.OpenAI) -> None:
    error = expect_400(lambda: client.chat.completions.create(model=MODEL, messages=[]))
    assert error["param"] == "messages"
    assert_still_serving(client)


def test_structured_outputs_not_an_object(client: openai.OpenAI) -> None:
    error = expect_400(lambda: client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, extra_body={"structured_outputs": "json"},
    ))
    assert error["param"] == "structured_outputs"
    assert_still_serving(client)
