"""The OpenAI Agents SDK (`openai-agents`) against a live corral, on both of its OpenAI models: the Responses
model (`POST /v1/responses`) and the Chat Completions model (`POST /v1/chat/completions`).

The served model is random (corral-tiny), so each test rests on a corral guarantee, checked on the wire
through a recording proxy, never on the model obeying a prompt:

- `output_type=<pydantic model>` goes out as a strict JSON Schema (`text.format` on Responses,
  `response_format` on Chat Completions), enforced token by token: `final_output` is an instance;
- a `@function_tool` under `tool_choice="required"` goes out as a function tool whose arguments corral
  generates under the tool's `parameters`, so the tool runs with arguments of the declared types;
  `tool_use_behavior="stop_on_first_tool"` ends the run there (a random model would not end it);
- with the default `run_llm_again` the SDK resets `tool_choice` to `auto` after the first call and sends
  the call and its output back; whether the random model then answers or calls again is its choice, so a run
  that only calls again until `max_turns` is an expected failure (every turn's validity is still asserted).

Tracing is off, and every test refuses and records outbound connections beyond loopback (the pattern of
tests/e2e/test_client_compat.py): the SDK's trace exporter would otherwise post to api.openai.com.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

import client_wire
import jsonschema
import pytest
from client_wire import Exchange, Recorder
from pydantic import BaseModel, Field

# The shared proxy and network guard (tests/e2e/client_wire.py), as this module's fixtures.
proxy, wire, no_outside_network = client_wire.proxy, client_wire.wire, client_wire.no_outside_network

MODEL = "corral-tiny"
PROMPT = "Describe a city."
MAX_TOKENS = 300
KINDS = ["responses", "chat"]


class City(BaseModel):
    """An agent's structured output: required fields, an enum, a bound and a bounded list."""

    name: str
    country: Literal["France", "Japan", "Peru"]
    population: int = Field(ge=0)
    districts: list[str] = Field(max_length=3)


# -- helpers --------------------------------------------------------------------------------------------------


def _model(kind: str, wire: Recorder) -> Any:
    """The Agents SDK's model for `kind`, on a fresh AsyncOpenAI client (one per event loop) at the proxy."""
    from agents import OpenAIChatCompletionsModel, OpenAIResponsesModel, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=wire.v1, api_key="unused", max_retries=0)
    if kind == "responses":
        return OpenAIResponsesModel(MODEL, openai_client=client)
    return OpenAIChatCompletionsModel(MODEL, openai_client=client)


def _path(kind: str) -> str:
    return "/v1/responses" if kind == "responses" else "/v1/chat/completions"


def _settings(**kwargs: Any) -> Any:
    from agents import ModelSettings

    kwargs.setdefault("max_tokens", MAX_TOKENS)
    return ModelSettings(extra_body={"seed": 0}, **kwargs)


def _run(agent: Any, *, streamed: bool = False, max_turns: int = 3) -> Any:
    from agents import Runner

    async def go() -> Any:
        if not streamed:
            return await Runner.run(agent, PROMPT, max_turns=max_turns)
        result = Runner.run_streamed(agent, PROMPT, max_turns=max_turns)
        async for _ in result.stream_events():
            pass
        return result

    return asyncio.run(go())


def _output_schema_sent(kind: str, exchange: Exchange) -> dict[str, Any]:
    """The JSON Schema the SDK sent for `output_type`, checked to be a strict json_schema format."""
    if kind == "responses":
        fmt = exchange.request["text"]["format"]
        assert fmt["type"] == "json_schema" and fmt["strict"] is True, fmt
        return dict(fmt["schema"])
    fmt = exchange.request["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["strict"] is True, fmt
    return dict(fmt["json_schema"]["schema"])


def _answer_text(kind: str, exchange: Exchange) -> str:
    """The one text answer in corral's raw (non-streamed) body."""
    if kind == "responses":
        body = exchange.response
        assert body["status"] == "completed", body
        messages = [item for item in body["output"] if item["type"] == "message"]
        assert len(messages) == 1, body["output"]
        return str(messages[0]["content"][0]["text"])
    choice = exchange.response["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    return str(choice["message"]["content"])


def _calls(kind: str, response: Any) -> list[tuple[str, dict[str, Any]]]:
    """(name, arguments) of every call in one of corral's raw bodies (a streamed one reassembled)."""
    if isinstance(response, list) and kind == "responses":
        assert response[-1]["type"] == "response.completed", [e["type"] for e in response]
        response = response[-1]["response"]
    elif isinstance(response, list):
        parts: dict[int, list[str]] = {}
        for chunk in response:
            for delta in (c["delta"].get("tool_calls") or [] for c in chunk.get("choices") or []):
                for piece in delta:
                    name = (piece.get("function") or {}).get("name")
                    parts.setdefault(piece["index"], [name or "", ""])
                    parts[piece["index"]][1] += (piece.get("function") or {}).get("arguments") or ""
        return [(name, json.loads(arguments)) for name, arguments in parts.values()]
    if kind == "responses":
        return [(item["name"], json.loads(item["arguments"])) for item in response["output"]
                if item["type"] == "function_call"]
    calls = response["choices"][0]["message"].get("tool_calls") or []
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def _tool_parameters(kind: str, exchange: Exchange, name: str) -> dict[str, Any]:
    for tool in exchange.request["tools"]:
        if kind == "responses" and tool.get("name") == name:
            assert tool["type"] == "function" and tool["strict"] is True, tool
            return dict(tool["parameters"])
        if kind == "chat" and tool["function"]["name"] == name:
            return dict(tool["function"]["parameters"])
    raise AssertionError(f"{name} not among the tools sent: {exchange.request['tools']}")


def _weather_tool(calls: list[tuple[str, int, str]]) -> Any:
    from agents import function_tool

    @function_tool
    def get_weather(city: str, days: int, unit: Literal["celsius", "fahrenheit"]) -> str:
        """Forecast for a city.

        Args:
            city: The city.
            days: How many days ahead.
            unit: The temperature unit.
        """
        calls.append((city, days, unit))
        return "rain"

    return get_weather


def _assert_called_with_declared_types(ran: list[tuple[str, int, str]]) -> None:
    assert ran, "the tool never ran"
    for city, days, unit in ran:
        assert isinstance(city, str)
        assert isinstance(days, int) and not isinstance(days, bool)
        assert unit in ("celsius", "fahrenheit")


# -- structured output ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_output_type_gives_an_instance(wire: Recorder, kind: str) -> None:
    from agents import Agent

    agent = Agent(name="city", instructions="Describe a city as JSON.", model=_model(kind, wire),
                  output_type=City, model_settings=_settings())
    result = _run(agent)
    assert isinstance(result.final_output, City), result.final_output
    assert result.final_output.population >= 0 and len(result.final_output.districts) <= 3
    [sent] = wire.posts(_path(kind))
    assert sent.status == 200, sent.response
    schema = _output_schema_sent(kind, sent)
    answer = json.loads(_answer_text(kind, sent))
    jsonschema.validate(answer, schema)
    assert result.final_output == City.model_validate(answer)
    if kind == "responses":
        assert sent.request["instructions"] == "Describe a city as JSON."
        assert sent.request["max_output_tokens"] == MAX_TOKENS
    assert wire.exchanges == [sent]


def test_output_type_streamed_on_the_responses_model(wire: Recorder) -> None:
    """`Runner.run_streamed` reads the Responses event stream; the final output is still an instance."""
    from agents import Agent

    agent = Agent(name="city", instructions="Describe a city as JSON.", model=_model("responses", wire),
                  output_type=City, model_settings=_settings())
    result = _run(agent, streamed=True)
    assert isinstance(result.final_output, City), result.final_output
    [sent] = wire.posts("/v1/responses")
    assert sent.status == 200 and sent.request["stream"] is True
    events = sent.response
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed", events
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert result.final_output == City.model_validate_json(text)


# -- function tools -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
@pytest.mark.parametrize("kind", KINDS)
def test_required_tool_runs_with_typed_arguments(wire: Recorder, kind: str, streamed: bool) -> None:
    from agents import Agent

    ran: list[tuple[str, int, str]] = []
    agent = Agent(name="weather", instructions="Use the tool.", model=_model(kind, wire),
                  tools=[_weather_tool(ran)], tool_use_behavior="stop_on_first_tool",
                  model_settings=_settings(tool_choice="required", parallel_tool_calls=False))
    result = _run(agent, streamed=streamed)
    [sent] = wire.posts(_path(kind))
    assert sent.status == 200, sent.response
    assert bool(sent.request.get("stream")) is streamed
    assert sent.request["tool_choice"] == "required"
    calls = _calls(kind, sent.response)
    assert len(calls) == 1 and calls[0][0] == "get_weather", sent.response
    jsonschema.validate(calls[0][1], _tool_parameters(kind, sent, "get_weather"))
    assert ran == [(calls[0][1]["city"], calls[0][1]["days"], calls[0][1]["unit"])]
    _assert_called_with_declared_types(ran)
    assert result.final_output == "rain"


@pytest.mark.parametrize("kind", KINDS)
def test_named_tool_choice_with_an_output_type(wire: Recorder, kind: str) -> None:
    """A forced (named) call together with `output_type`: the SDK sends both the tool choice and the output
    format in one request, which corral accepts; the call comes under the tool's parameters."""
    from agents import Agent

    ran: list[tuple[str, int, str]] = []
    agent = Agent(name="weather", instructions="Use the tool.", model=_model(kind, wire),
                  tools=[_weather_tool(ran)], output_type=City, tool_use_behavior="stop_on_first_tool",
                  model_settings=_settings(tool_choice="get_weather", parallel_tool_calls=False))
    result = _run(agent)
    [sent] = wire.posts(_path(kind))
    assert sent.status == 200, sent.response
    _output_schema_sent(kind, sent)
    calls = _calls(kind, sent.response)
    assert [name for name, _ in calls] == ["get_weather"], sent.response
    jsonschema.validate(calls[0][1], _tool_parameters(kind, sent, "get_weather"))
    _assert_called_with_declared_types(ran)
    assert result.final_output == "rain"


@pytest.mark.parametrize("kind", KINDS)
def test_required_tool_then_structured_answer(wire: Recorder, kind: str) -> None:
    """The SDK's default loop: turn 1 is forced (`required`, with the output format beside it), the tool
    runs, and turn 2 goes out with `tool_choice` reset to `auto` and the call and its output in the input.
    corral must accept every turn and keep each branch valid; whether the random model answers (a City) or
    keeps calling until `max_turns` is its choice, and only the latter is an expected failure."""
    from agents import Agent, MaxTurnsExceeded

    ran: list[tuple[str, int, str]] = []
    agent = Agent(name="weather", instructions="Use the tool, then describe the city.", model=_model(kind, wire),
                  tools=[_weather_tool(ran)], output_type=City,
                  model_settings=_settings(tool_choice="required", parallel_tool_calls=False))
    try:
        result = _run(agent, max_turns=3)
        final: Any = result.final_output
    except MaxTurnsExceeded:
        final = None
    turns = wire.posts(_path(kind))
    assert len(turns) >= 2, [t.response for t in turns]
    assert all(t.status == 200 for t in turns), [t.response for t in turns if t.status != 200]
    assert turns[0].request["tool_choice"] == "required"
    assert all(t.request.get("tool_choice") in (None, "auto") for t in turns[1:]), [t.request for t in turns]
    for turn in turns:
        for name, arguments in _calls(kind, turn.response):
            jsonschema.validate(arguments, _tool_parameters(kind, turn, name))
    # Turn 2 carries turn 1's call and the tool's output back.
    second = json.dumps(turns[1].request.get("input" if kind == "responses" else "messages"))
    assert "rain" in second and "get_weather" in second
    _assert_called_with_declared_types(ran)
    if final is None:
        assert all(_calls(kind, t.response) for t in turns), "a turn without a call ended the run early"
        pytest.xfail("the random model kept calling the tool under tool_choice auto until max_turns "
                     "(every turn accepted, every call valid)")
    assert isinstance(final, City), final
    jsonschema.validate(json.loads(_answer_text(kind, turns[-1])), _output_schema_sent(kind, turns[-1]))


@pytest.mark.parametrize("kind", KINDS)
def test_auto_tool_choice_needs_the_model_to_call(wire: Recorder, kind: str) -> None:
    """With `tool_choice` left to the model (`auto`, the default), calling the tool is the model's decision;
    corral constrains whichever branch it opens, but a random model that answers in text never runs the tool.
    The request is checked on the wire (tool offered, no call forced) before the expected failure."""
    from agents import Agent

    ran: list[tuple[str, int, str]] = []
    agent = Agent(name="weather", instructions="Use the tool.", model=_model(kind, wire),
                  tools=[_weather_tool(ran)], tool_use_behavior="stop_on_first_tool",
                  model_settings=_settings(max_tokens=32))
    result = _run(agent)
    sent = wire.posts(_path(kind))[0]
    assert sent.status == 200, sent.response
    assert sent.request.get("tool_choice") in (None, "auto")
    if not ran:
        assert _calls(kind, sent.response) == [], sent.response
        assert isinstance(result.final_output, str)
        pytest.xfail("tool_choice auto: the random model answered in text instead of calling the tool "
                     "(checked on the wire: the tool was offered, no call forced, none made)")
    _assert_called_with_declared_types(ran)
    assert result.final_output == "rain"
