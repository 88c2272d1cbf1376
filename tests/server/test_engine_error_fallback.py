"""A grammar engine that fails a request mid-answer (it refuses a token its own mask allowed: llguidance did so
on every Hermes call of Qwen 2.5, issue 52) is never silent: the engine logs a warning with the request id and
the matcher's cause, the response's `grammar` extras name the failure class and the cause, and under `auto` the
request is generated again on the next backend, as a compile refusal would send it there — unstreamed, and
streamed when nothing of it was sent yet. The failure is simulated: llguidance's matchers refuse every token."""

from __future__ import annotations

import json
import logging
from typing import Any

import openai
import pytest

from corral.grammar_engines.llguidance_backend import LLGuidanceMatcher

MODEL = "corral-tiny"
CAUSE = "simulated: the matcher refused a token its mask allowed"
TIME_TOOL: list[Any] = [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]
NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.fixture()
def failing_llguidance(monkeypatch: pytest.MonkeyPatch) -> None:
    """llguidance's matchers, for one test, refuse every token their (real) masks allow, as they refused
    `<tool_call>` on Qwen 2.5."""
    monkeypatch.setattr(LLGuidanceMatcher, "accept_token", lambda self, token_id: False)
    monkeypatch.setattr(LLGuidanceMatcher, "error", property(lambda self: CAUSE))
    monkeypatch.setattr(LLGuidanceMatcher, "forced_tokens", lambda self: [])


def ask(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What time is it?"}], max_tokens=40, seed=0, **kwargs
    )


def logged_naming(caplog: pytest.LogCaptureFixture, request_id: str, level: int = logging.WARNING) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level and request_id in r.getMessage()]


@pytest.mark.usefixtures("failing_llguidance")
def test_auto_runs_a_call_again_on_the_other_engine(client: openai.OpenAI, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    resp = ask(client, tools=TIME_TOOL, tool_choice=NAMED)
    grammar = resp.model_extra["grammar"]
    assert grammar["fallback_from"] == "llguidance" and grammar["backend"] == "xgrammar"
    assert resp.choices[0].finish_reason == "tool_calls" and grammar["valid"] is True
    assert resp.choices[0].message.tool_calls[0].function.name == "get_time"
    request_id = resp.id.removeprefix("chatcmpl-")
    warned = logged_naming(caplog, request_id)
    assert any("grammar engine error" in m and CAUSE in m for m in warned), warned  # the engine, with the cause
    assert any("regenerating with xgrammar" in m for m in logged_naming(caplog, request_id, logging.INFO))


@pytest.mark.usefixtures("failing_llguidance")
def test_auto_runs_a_json_answer_again_too(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
    resp = ask(client, response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}})
    grammar = resp.model_extra["grammar"]
    assert grammar["fallback_from"] == "llguidance" and grammar["backend"] == "xgrammar"
    assert json.loads(resp.choices[0].message.content)["zone"] in ("UTC", "CET")


@pytest.mark.usefixtures("failing_llguidance")
def test_a_streamed_call_is_run_again_before_anything_was_sent(client: openai.OpenAI) -> None:
    chunks = list(ask(client, tools=TIME_TOOL, tool_choice=NAMED, stream=True))
    last = chunks[-1]
    assert last.choices[0].finish_reason == "tool_calls"
    assert last.model_extra["grammar"]["fallback_from"] == "llguidance"
    assert last.model_extra["grammar"]["backend"] == "xgrammar"
    arguments = "".join(
        call.function.arguments or ""
        for chunk in chunks for choice in chunk.choices for call in (choice.delta.tool_calls or [])
    )
    assert json.loads(arguments)["zone"] in ("UTC", "CET")


@pytest.mark.usefixtures("failing_llguidance")
@pytest.mark.parametrize("stream", [False, True])
def test_a_named_engine_reports_the_error_and_its_cause(client: openai.OpenAI, caplog: pytest.LogCaptureFixture,
                                                        stream: bool) -> None:
    caplog.set_level(logging.WARNING)
    extra = {"structured_outputs": {"backend": "llguidance"}}
    if stream:
        last = list(ask(client, tools=TIME_TOOL, tool_choice=NAMED, extra_body=extra, stream=True))[-1]
        choice, extras, request_id = last.choices[0], last.model_extra, last.id.removeprefix("chatcmpl-")
        assert not choice.delta.tool_calls and not choice.delta.content
    else:
        resp = ask(client, tools=TIME_TOOL, tool_choice=NAMED, extra_body=extra)
        choice, extras, request_id = resp.choices[0], resp.model_extra, resp.id.removeprefix("chatcmpl-")
        assert not choice.message.content and not choice.message.tool_calls
    assert choice.finish_reason == "content_filter" and choice.model_extra["corral_finish_reason"] == "error"
    grammar = extras["grammar"]
    assert grammar["failure"] == "engine_error" and grammar["fallback_from"] is None
    assert CAUSE in grammar["validation_error"] and "llguidance" in grammar["validation_error"]
    assert any(CAUSE in m for m in logged_naming(caplog, request_id))
