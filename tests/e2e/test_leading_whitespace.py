"""Where a JSON answer starts (docs/constraints.md, "Leading whitespace"), over HTTP with the official SDK: at its
first bracket by default, after one space when the request or the server allows it, the value the same either
way. The model is pushed towards ` {` with logit_bias, as a base model writes it after `JSON:`."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
from conftest import RunningServer, serving

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _ask(server: RunningServer, **extra: Any) -> str:
    tokenizer: Any = server.service.loaded.tokenizer
    spaced = [ids[0] for ids in (tokenizer.encode(t, add_special_tokens=False) for t in (" {", ' {"')) if len(ids) == 1]
    assert spaced, "the tokenizer has no one-token ` {`"
    client: Any = server.client()
    resp = client.chat.completions.create(
        model="corral-tiny",
        messages=[{"role": "user", "content": "JSON:"}],
        response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}},
        max_tokens=24,
        temperature=0,
        logit_bias={str(i): 100 for i in spaced},
        extra_body=extra,
    )
    content: str = resp.choices[0].message.content
    jsonschema.validate(json.loads(content), SCHEMA)
    return content


def test_by_default_the_answer_starts_at_its_bracket(server: RunningServer) -> None:
    assert _ask(server).startswith("{")


def test_the_request_can_allow_one_space_first(server: RunningServer) -> None:
    content = _ask(server, json_leading_whitespace=True)
    assert content.startswith(" {") and not content.startswith("  ")


def test_the_server_can_allow_it_and_the_request_can_still_refuse() -> None:
    with serving(json_leading_whitespace=True) as running:
        assert _ask(running).startswith(" {")
        assert _ask(running, json_leading_whitespace=False).startswith("{")
