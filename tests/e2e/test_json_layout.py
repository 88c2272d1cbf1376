"""A JSON answer's layout (docs/constraints.md, "JSON layout"), over HTTP with the official SDK: one line by default,
the model's own layout (newlines and indents, each gap bounded) with `json_whitespace: "free"` in the request or
`--json-whitespace free` on the server, on chat, completions and responses; any other value is a 400 naming the
field. The model is pushed towards newlines with logit_bias, as an instruction-tuned model writes them."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from conftest import RunningServer, serving
from test_bad_input import expect_400

from corral.grammars.spec import FREE_GAP_INDENT, FREE_GAP_NEWLINES, GrammarSpec

MODEL = "corral-tiny"
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}


def _newline_bias(server: RunningServer) -> dict[str, int]:
    tokenizer: Any = server.service.loaded.tokenizer  # type: ignore[attr-defined]
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in ("\n", "\n\n", "\n ", "\n  ")]
    newlines = [i[0] for i in ids if len(i) == 1]
    assert newlines, "the tokenizer has no one-token newline"
    return {str(i): 100 for i in newlines}


def _chat(server: RunningServer, backend: str = "auto", **extra: Any) -> str:
    client: Any = server.client()
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "JSON:"}],
        max_tokens=96,
        temperature=0,
        logit_bias=_newline_bias(server),
        extra_body={"structured_outputs": {"json": SCHEMA, "backend": backend}, **extra},
    )
    content: str = resp.choices[0].message.content
    jsonschema.validate(json.loads(content), SCHEMA)
    return content


def test_by_default_a_json_answer_is_one_line(server: RunningServer) -> None:
    content = _chat(server)
    assert "\n" not in content and content.startswith("{"), content


@pytest.mark.parametrize("backend", ["auto", "xgrammar", "llguidance"])
def test_the_request_can_let_the_model_keep_its_layout(server: RunningServer, backend: str) -> None:
    content = _chat(server, backend, json_whitespace="free")
    assert "\n" in content and content.startswith("{"), content
    # Every gap bounded (the keys and values here hold no whitespace); llguidance's in llama.cpp's shape too.
    gaps = re.findall(r"\s+", content)
    assert all(len(gap) <= FREE_GAP_NEWLINES + FREE_GAP_INDENT for gap in gaps), content
    if backend != "xgrammar":
        assert all(gap.count("\n") <= FREE_GAP_NEWLINES for gap in gaps), content


def test_completions_take_it_too(server: RunningServer) -> None:
    client: Any = server.client()
    resp = client.completions.create(
        model=MODEL, prompt="JSON:", max_tokens=64, temperature=0, logit_bias=_newline_bias(server),
        extra_body={"response_format": {"type": "json_object"}, "json_whitespace": "free"},
    )
    text: str = resp.choices[0].text
    assert "\n" in text and isinstance(json.loads(text), dict), text


def test_responses_reach_the_compiled_spec(server: RunningServer) -> None:
    """The Responses API has no logit_bias to push the model: the spec it compiled says what it asked."""
    schema = {**SCHEMA, "properties": {**SCHEMA["properties"], "responses": {"type": "string"}}}
    client: Any = server.client()
    client.responses.create(
        model=MODEL, input="JSON:", max_output_tokens=48, temperature=0,
        text={"format": {"type": "json_schema", "name": "t", "schema": schema}}, extra_body={"json_whitespace": "free"},
    )
    cache: Any = server.service.grammars  # type: ignore[attr-defined]
    assert cache.lookup(GrammarSpec.json_schema(schema).with_whitespace("free")) is not None
    assert cache.lookup(GrammarSpec.json_schema(schema)) is None


def test_the_compile_endpoint_names_the_layout(server: RunningServer) -> None:
    body = {"structured_outputs": {"json": SCHEMA}}
    fixed = httpx.post(f"{server.base_url}/v1/grammars", json=body, timeout=60).json()
    loose = httpx.post(f"{server.base_url}/v1/grammars", json={**body, "json_whitespace": "free"}, timeout=60).json()
    assert not fixed["key"].endswith(":whitespace_free") and loose["key"] == fixed["key"] + ":whitespace_free"


def test_the_server_can_default_to_it_and_the_request_can_still_refuse() -> None:
    with serving(json_whitespace="free") as running:
        assert "\n" in _chat(running)
        assert "\n" not in _chat(running, json_whitespace="fixed")


@pytest.mark.parametrize("value", ["loose", True, 1])
def test_any_other_value_is_a_400_naming_the_field(server: RunningServer, value: Any) -> None:
    client: openai.OpenAI = server.client()  # type: ignore[assignment]
    extra = {"json_whitespace": value}
    calls = [
        lambda: client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=4, extra_body=extra),
        lambda: client.completions.create(model=MODEL, prompt="hi", max_tokens=4, extra_body=extra),
        lambda: client.responses.create(model=MODEL, input="hi", max_output_tokens=4, extra_body=extra),
    ]
    for call in calls:
        assert expect_400(call)["param"] == "json_whitespace"
    answer = httpx.post(f"{server.base_url}/v1/grammars", json={"structured_outputs": {"json": SCHEMA}, **extra})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "json_whitespace"


def test_the_server_flag_and_its_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from corral.server.cli import _serve_parser, settings_from_args
    from corral.server.settings import Settings

    parser = argparse.ArgumentParser()
    _serve_parser(parser.add_subparsers(dest="command"))
    assert Settings().json_whitespace == "fixed"  # the default, until measured
    assert settings_from_args(parser.parse_args(["serve", "--json-whitespace", "free"])).json_whitespace == "free"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--json-whitespace", "loose"])
    monkeypatch.setenv("CORRAL_JSON_WHITESPACE", "free")
    assert Settings().json_whitespace == "free"
