"""Tool calls through the official SDK against a real server on the embedded default model (llama3_json
format): each tool_choice, parallel calls, streaming, multi-turn history, `parse` with pydantic tools, bad
input, and JSONSchemaBench schemas as function parameters."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pydantic
import pytest
from conftest import SAMPLE_BENCH, RunningServer

MODEL = "corral-tiny"
MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather in Oslo?"}]
WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def ask(client: openai.OpenAI, **kwargs: Any) -> Any:
    kwargs.setdefault("messages", MESSAGES)
    kwargs.setdefault("tools", TOOLS)
    kwargs.setdefault("max_tokens", 200)
    kwargs.setdefault("seed", 0)
    return client.chat.completions.create(model=MODEL, **kwargs)


def valid_calls(message: Any, schemas: dict[str, Any] = SCHEMAS) -> list[Any]:
    """The message's tool calls, each checked against its function's schema."""
    assert message.tool_calls, message
    assert message.content is None
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    return list(message.tool_calls)


def test_required_returns_valid_calls(client: openai.OpenAI) -> None:
    resp = ask(client, tool_choice="required")
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert len(valid_calls(choice.message)) >= 1
    assert resp.model_extra["grammar"]["kind"] == "tool_calls" and resp.model_extra["grammar"]["valid"] is True


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_each_engine_serves_tool_calls(client: openai.OpenAI, backend: str) -> None:
    resp = ask(client, tool_choice="required", extra_body={"structured_outputs": {"backend": backend}})
    assert resp.choices[0].finish_reason == "tool_calls"
    valid_calls(resp.choices[0].message)
    assert resp.model_extra["grammar"]["backend"] == backend


def test_named_function_is_the_only_one_called(client: openai.OpenAI) -> None:
    resp = ask(client, tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = valid_calls(resp.choices[0].message)
    assert {c.function.name for c in calls} == {"get_time"}


def test_parallel_off_gives_exactly_one_call(client: openai.OpenAI) -> None:
    resp = ask(client, tool_choice="required", parallel_tool_calls=False)
    assert len(valid_calls(resp.choices[0].message)) == 1


def test_auto_may_answer_text(client: openai.OpenAI) -> None:
    # The default model's bias ends free text at once; under `auto` that is a (short) text answer.
    choice = ask(client, tool_choice="auto").choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert isinstance(choice.message.content, str)


def test_auto_calls_a_tool_when_the_model_opens_a_call(client: openai.OpenAI) -> None:
    # Push the first token towards `{"` (the llama3_json call opener): under `auto` it must become a valid call.
    from transformers import AutoTokenizer

    from corral.server.models import ensure_default_model

    opener = AutoTokenizer.from_pretrained(ensure_default_model()).encode('{"', add_special_tokens=False)
    assert len(opener) == 1
    resp = ask(client, tool_choice="auto", logit_bias={str(opener[0]): 100})
    assert resp.choices[0].finish_reason == "tool_calls"
    valid_calls(resp.choices[0].message)


def test_none_generates_no_call(client: openai.OpenAI) -> None:
    resp = ask(client, tool_choice="none")
    assert resp.choices[0].message.tool_calls is None and resp.choices[0].finish_reason == "stop"
    assert resp.model_extra["grammar"] is None  # unconstrained, as without tools


def test_auto_with_response_format_constrains_the_text_branch(client: openai.OpenAI) -> None:
    answer = {"type": "object", "properties": {"reply": {"type": "string"}}, "required": ["reply"],
              "additionalProperties": False}
    resp = ask(client, tool_choice="auto",
               response_format={"type": "json_schema", "json_schema": {"name": "reply", "schema": answer}})
    message = resp.choices[0].message
    if message.tool_calls:
        valid_calls(message)
    else:
        jsonschema.validate(json.loads(message.content), answer)


def test_streamed_calls_are_reassembled_by_the_sdk(client: openai.OpenAI) -> None:
    with client.chat.completions.stream(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                        max_tokens=200, seed=0) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.done" in events
    assert final.choices[0].finish_reason == "tool_calls"
    streamed = valid_calls(final.choices[0].message)
    # Same seed, not streamed: the same calls.
    plain = ask(client, tool_choice="required").choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in plain]


def test_stream_chunks_carry_openai_tool_call_deltas(client: openai.OpenAI) -> None:
    chunks = list(ask(client, tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [d.tool_calls[0] for d in deltas if d.tool_calls]
    assert calls[0].index == 0 and calls[0].id and calls[0].type == "function"
    assert calls[0].function.name == "get_weather" and calls[0].function.arguments == ""
    assert all(c.id is None and c.function.name is None for c in calls[1:])
    assert len(calls) > 2  # the arguments arrive in pieces
    jsonschema.validate(json.loads("".join(c.function.arguments or "" for c in calls)), WEATHER)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_multi_turn_with_tool_results(client: openai.OpenAI) -> None:
    first = ask(client, tool_choice="required").choices[0].message
    history: list[Any] = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in first.tool_calls]},
        *[{"role": "tool", "tool_call_id": c.id, "content": '{"forecast": "rain"}'} for c in first.tool_calls],
    ]
    again = ask(client, messages=history, tool_choice="required")
    valid_calls(again.choices[0].message)
    assert again.usage.prompt_tokens > ask(client, tool_choice="required").usage.prompt_tokens
    text = ask(client, messages=history, tool_choice="none").choices[0]
    assert text.finish_reason == "stop" and text.message.tool_calls is None


class Forecast(pydantic.BaseModel):
    city: str
    days: int = pydantic.Field(ge=1, le=7)


def test_parse_with_pydantic_function_tool(client: openai.OpenAI) -> None:
    resp = client.chat.completions.parse(model=MODEL, messages=MESSAGES, max_tokens=200, tool_choice="required",
                                         tools=[openai.pydantic_function_tool(Forecast)])
    call = resp.choices[0].message.tool_calls[0]
    assert call.function.name == "Forecast"
    assert isinstance(call.function.parsed_arguments, Forecast)


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}]},
     "tools[0].function.parameters"),
    ({"tools": [TOOLS[0], {"type": "retrieval"}]}, "tools[1].type"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    # Beside a forced call a JSON format is accepted (it shapes a later turn); another constraint is not.
    ({"tools": TOOLS, "tool_choice": "required", "extra_body": {"structured_outputs": {"choice": ["a"]}}},
     "structured_outputs.choice"),
    ({"tools": TOOLS, "extra_body": {"structured_outputs": {"regex": "a+"}}}, "structured_outputs.regex"),
    ({"messages": [*MESSAGES, {"role": "tool", "content": "x"}]}, "messages[1].tool_call_id"),
    ({"messages": [*MESSAGES, {"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "get_time", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
])
def test_bad_tool_input_is_a_400_naming_the_field(client: openai.OpenAI, fields: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, **fields)
    assert caught.value.body["param"] == param, caught.value.body  # type: ignore[index]


def _bench_schemas() -> list[tuple[str, Any]]:
    picked = []
    for subset in ("Github_easy", "Glaiveai2K", "Kubernetes", "WashingtonPost"):
        for path in sorted((SAMPLE_BENCH / subset).glob("*.json"))[:2]:
            picked.append((f"{subset}/{path.stem}", json.loads(Path(path).read_text())["schema"]))
    return picked


@pytest.mark.parametrize(("name", "schema"), _bench_schemas(), ids=[n for n, _ in _bench_schemas()])
def test_jsonschemabench_schemas_as_parameters(server: RunningServer, name: str, schema: Any) -> None:
    client: Any = server.client()
    tool = {"type": "function", "function": {"name": "fill", "parameters": schema}}
    try:
        resp = ask(client, tools=[tool], tool_choice="required", max_tokens=400)
    except openai.BadRequestError as exc:  # no engine compiles it: refused, never unconstrained
        assert exc.body["param"] == "tools"  # type: ignore[index]
        return
    choice = resp.choices[0]
    if choice.finish_reason == "tool_calls":
        valid_calls(choice.message, {"fill": schema})
    else:  # cut short or failed: never returned as calls
        assert choice.message.tool_calls is None
