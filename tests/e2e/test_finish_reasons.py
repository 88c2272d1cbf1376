"""finish_reason as OpenAI's clients read it: every path validates against the SDK's own types with the enum
checked strictly, and the SDK's `parse` raises its finish-reason error for every failure (never returns a
failed constraint as a result). corral's precise reason rides beside it in `corral_finish_reason`."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, get_args

import httpx
import openai
import pytest
from conftest import RunningServer
from openai.lib._parsing._completions import parse_chat_completion
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.chat.chat_completion import Choice
from openai.types.completion_choice import CompletionChoice

from corral.server.openai.finish import FinishReason, finish_fields, openai_finish_reason

MODEL = "corral-tiny"
MESSAGES: list[Any] = [{"role": "user", "content": "Answer in the requested shape."}]
CHAT_ENUM = set(get_args(Choice.model_fields["finish_reason"].annotation))
COMPLETION_ENUM = set(get_args(CompletionChoice.model_fields["finish_reason"].annotation))
ONE_OF = {"oneOf": [{"const": 1}, {"enum": [1, 2]}]}  # xgrammar relaxes it to anyOf: "1" passes its grammar


def _post(base: str, body: dict[str, Any], path: str = "chat/completions") -> dict[str, Any]:
    resp = httpx.post(f"{base}/v1/{path}", json={"model": MODEL, "messages": MESSAGES, **body}, timeout=120)
    assert resp.status_code == 200, resp.text
    data: dict[str, Any] = resp.json()
    return data


def _validated(data: dict[str, Any]) -> Choice:
    """Validate with the SDK's pydantic type (its Literal is the enum) and return the choice."""
    completion = ChatCompletion.model_validate(data)
    choice = completion.choices[0]
    assert choice.finish_reason in CHAT_ENUM
    return choice


def _parse_raises(data: dict[str, Any]) -> None:
    """What `client.chat.completions.parse` does with this body: its finish-reason error, never a result."""
    with pytest.raises((openai.LengthFinishReasonError, openai.ContentFilterFinishReasonError)):
        parse_chat_completion(
            response_format=openai.omit, input_tools=openai.omit, chat_completion=ChatCompletion.model_validate(data)
        )


def _bias_toward(server: RunningServer, text: str) -> dict[str, int]:
    loaded: Any = server.service.loaded  # type: ignore[attr-defined]
    token = loaded.tokenizer.encode(text, add_special_tokens=False)[0]
    return {str(token): 100, str(loaded.revision_token_id): -100}


def test_stop_validates_and_parse_returns(server: RunningServer, client: openai.OpenAI) -> None:
    body = {"max_tokens": 20, "structured_outputs": {"choice": ["yes", "no"]}}
    choice = _validated(_post(server.base_url, body))
    assert choice.finish_reason == "stop"
    assert (choice.model_extra or {})["corral_finish_reason"] == "stop"
    resp = client.chat.completions.parse(
        model=MODEL, messages=MESSAGES, max_tokens=20, extra_body={"structured_outputs": {"choice": ["yes", "no"]}}
    )
    assert resp.choices[0].message.content in ("yes", "no")


def test_length_is_length_and_parse_raises(server: RunningServer, client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}, "minItems": 9}},
              "required": ["a"]}
    data = _post(server.base_url, {"max_tokens": 3, "structured_outputs": {"json": schema}})
    choice = _validated(data)
    assert (choice.finish_reason, (choice.model_extra or {})["corral_finish_reason"]) == ("length", "length")
    _parse_raises(data)
    with pytest.raises(openai.LengthFinishReasonError):
        client.chat.completions.parse(
            model=MODEL, messages=MESSAGES, max_tokens=3,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        )


def test_stall_reads_as_length(server: RunningServer, client: openai.OpenAI) -> None:
    body = {"max_tokens": 200, "logit_bias": _bias_toward(server, " "), "structured_outputs": {"regex": "[ ]*x"}}
    data = _post(server.base_url, body)
    choice = _validated(data)
    assert (choice.finish_reason, (choice.model_extra or {})["corral_finish_reason"]) == ("length", "stall")
    assert data["grammar"]["watchdog"] == "stall"
    _parse_raises(data)
    with pytest.raises(openai.LengthFinishReasonError):
        client.chat.completions.parse(
            model=MODEL, messages=MESSAGES, max_tokens=200, logit_bias=_bias_toward(server, " "),
            extra_body={"structured_outputs": {"regex": "[ ]*x"}},
        )


def test_revision_depth_exceeded_reads_as_length(server: RunningServer) -> None:
    loaded: Any = server.service.loaded  # type: ignore[attr-defined]
    body = {"max_tokens": 20, "temperature": 0, "seed": 3, "logit_bias": {str(loaded.revision_token_id): 100},
            "max_revisions": 1, "ignore_eos": True}
    data = _post(server.base_url, body)
    choice = _validated(data)
    assert (choice.finish_reason, (choice.model_extra or {})["corral_finish_reason"]) == (
        "length", "revision_depth_exceeded")
    _parse_raises(data)


def test_invalid_output_reads_as_content_filter(server: RunningServer, client: openai.OpenAI) -> None:
    structured = {"json": ONE_OF, "backend": "xgrammar"}
    data = _post(server.base_url, {"max_tokens": 20, "logit_bias": _bias_toward(server, "1"),
                                   "structured_outputs": structured})
    choice = _validated(data)
    assert choice.message.content == "1"
    assert (choice.finish_reason, (choice.model_extra or {})["corral_finish_reason"]) == (
        "content_filter", "invalid_output")
    _parse_raises(data)
    with pytest.raises(openai.ContentFilterFinishReasonError):
        client.chat.completions.parse(
            model=MODEL, messages=MESSAGES, max_tokens=20, logit_bias=_bias_toward(server, "1"),
            extra_body={"structured_outputs": structured},
        )


def _sse(base: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    chunks = []
    payload = {"model": MODEL, "messages": MESSAGES, "stream": True, **body}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=payload, timeout=120) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    return chunks


def test_streamed_dead_end_reads_as_content_filter(server: RunningServer) -> None:
    """Under `auto` the contract guard withholds the stop after "1"; with no revision left that is a dead end
    (streamed answers are not regenerated). The last chunk carries both reasons."""
    body = {"max_tokens": 20, "logit_bias": _bias_toward(server, "1"), "max_revisions": 0,
            "structured_outputs": {"json": ONE_OF, "backend": "auto"}}
    chunks = _sse(server.base_url, body)
    parsed = [ChatCompletionChunk.model_validate(c) for c in chunks]
    reasons = [c.choices[0].finish_reason for c in parsed if c.choices]
    assert all(r is None for r in reasons[:-1]) and reasons[-1] == "content_filter"
    last = chunks[-1]["choices"][0]
    assert last["corral_finish_reason"] == "dead_end"
    assert chunks[-1]["grammar"]["watchdog"] == "dead_end"
    text = "".join(c.choices[0].delta.content or "" for c in parsed if c.choices)
    assembled = {"id": "x", "object": "chat.completion", "created": 0, "model": MODEL, "choices": [
        {"index": 0, "finish_reason": reasons[-1], "message": {"role": "assistant", "content": text}}]}
    _parse_raises(assembled)


def test_streamed_failure_raises_in_the_sdk_stream_helper(server: RunningServer, client: openai.OpenAI) -> None:
    from pydantic import BaseModel

    class Numbers(BaseModel):
        values: list[int]

    with pytest.raises(openai.LengthFinishReasonError), client.chat.completions.stream(
        model=MODEL, messages=MESSAGES, max_tokens=3, response_format=Numbers,
        logit_bias=_bias_toward(server, "1"),
    ) as stream:
        for _ in stream:
            pass


def test_completions_stay_in_their_enum(server: RunningServer) -> None:
    for body in ({"max_tokens": 2}, {"max_tokens": 20, "structured_outputs": {"json": ONE_OF, "backend": "xgrammar"},
                                     "logit_bias": _bias_toward(server, "1")}):
        resp = httpx.post(f"{server.base_url}/v1/completions", json={"model": MODEL, "prompt": "x", **body},
                          timeout=120)
        completion = Completion.model_validate(resp.json())
        assert completion.choices[0].finish_reason in COMPLETION_ENUM


def test_precise_mode_restores_corral_reasons(server: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    service: Any = server.service
    monkeypatch.setattr(service.settings, "finish_reasons", "precise")
    body = {"max_tokens": 200, "logit_bias": _bias_toward(server, " "), "structured_outputs": {"regex": "[ ]*x"}}
    choice = _post(server.base_url, body)["choices"][0]
    assert (choice["finish_reason"], choice["corral_finish_reason"]) == ("stall", "stall")


# -- mask_timeout: the shared server, with a mask budget every fill overruns for the length of one test -------

def test_mask_timeout_reads_as_length(server: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    engine: Any = server.service.engine  # type: ignore[attr-defined]
    impatient = replace(engine.config.limits, mask_budget_ms=1e-6, mask_overruns=0)
    monkeypatch.setattr(engine, "config", replace(engine.config, limits=impatient))  # read per new sequence
    data = _post(server.base_url, {"max_tokens": 20, "structured_outputs": {"json": {"type": "object"}}})
    choice = _validated(data)
    assert (choice.finish_reason, (choice.model_extra or {})["corral_finish_reason"]) == ("length", "mask_timeout")
    _parse_raises(data)


# -- the mapping itself -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("reason", list(FinishReason))
def test_every_reason_maps_into_the_enum_and_only_success_reads_as_success(reason: FinishReason) -> None:
    mapped = openai_finish_reason(reason)
    assert mapped in CHAT_ENUM
    success = reason in (FinishReason.STOP, FinishReason.TOOL_CALLS)
    assert (mapped in ("stop", "tool_calls")) == success
    if reason is not FinishReason.TOOL_CALLS:
        assert mapped in COMPLETION_ENUM


def test_unknown_reason_is_a_failure_and_chunks_carry_no_reason_until_the_end() -> None:
    assert openai_finish_reason("something_new") == "content_filter"
    assert finish_fields(None, "openai") == {"finish_reason": None}
    assert finish_fields("stall", "precise") == {"finish_reason": "stall", "corral_finish_reason": "stall"}
