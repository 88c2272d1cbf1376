"""The default model, qwen2.5-coder-1.5b-instruct (Qwen2.5-Coder 1.5B Instruct, an instruction-tuned model served
from its Q4_K_M GGUF's own blocks), end to end on 127.0.0.1 through the official SDK: the README's chat, extraction
and tool-call examples; tool calls under `required`, a named function and `auto`; a tool's result fed back and
the second turn answered in words; parallel calls; a streamed call; the Responses API; an openai-agents agent
with a tool and an output type, run to its final output.

Greedy (temperature 0) wherever a value is checked: the answers are then the model's, reproducibly.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import RunningServer, serving
from pydantic import BaseModel

MODEL = "qwen2.5-coder-1.5b-instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


class Person(BaseModel):
    name: str
    age: int
    city: str


@pytest.fixture(scope="module")
def qwen() -> Iterator[RunningServer]:
    with serving(model=MODEL) as running:
        yield running


def _client(server: RunningServer) -> Any:
    return server.client()


def test_the_readme_chat_answers_in_words(qwen: RunningServer) -> None:
    answer = _client(qwen).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name three colours."}], temperature=0)
    choice = answer.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == "Red, blue, green."


def test_the_readme_extraction_through_chat_and_responses(qwen: RunningServer) -> None:
    client = _client(qwen)
    sentence = "Extract the person from this sentence as JSON: My neighbour Tomás Berg, 58, moved to Lisbon last year."
    completion = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": sentence}], response_format=Person, temperature=0)
    expected = Person(name="Tomás Berg", age=58, city="Lisbon")
    assert completion.choices[0].message.parsed == expected
    assert completion.model_extra["grammar"]["schema_valid"] is True
    response = client.responses.parse(model=MODEL, input=sentence, text_format=Person, temperature=0)
    assert response.output_parsed == expected and response.status == "completed"


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_a_forced_tool_call_names_the_city(qwen: RunningServer, tool_choice: Any) -> None:
    """The README's tool call: the Hermes `<tool_call>` format (a special token of this vocabulary) under
    `required` and a named function, with the arguments generated under the tool's parameters."""
    answer = _client(qwen).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What's the weather in Oslo?"}], tools=[WEATHER, TIME],
        tool_choice=tool_choice, temperature=0)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}


def test_the_tools_result_is_answered_in_words(qwen: RunningServer) -> None:
    """The two-turn loop: the call, the tool's result fed back as a `tool` message, the second turn in words.
    The system message asks for it: without one this 1.5B model writes the call again as text in the second
    turn, through llama-server on the same file too (docs/tools.md). Whether its sentence names the city is a
    near-tie for this model: "The weather in Oslo is sunny..." or the result itself, "Sunny, 21 °C.", by the
    products' rounding (a prompt through the file's blocks or its repacked copy)."""
    client = _client(qwen)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a helpful assistant. When a tool's result comes back, answer the "
                                      "user's question in one sentence."},
        {"role": "user", "content": "What's the weather in Oslo?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="required",
                                           temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 °C."})
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], temperature=0)
    choice = second.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert "21" in choice.message.content and "get_weather" not in choice.message.content


def test_under_auto_the_model_calls_a_tool_or_answers_in_words(qwen: RunningServer) -> None:
    """`auto`: the model writes its call as a ```json block (as it does through llama-server), which corral reads as
    the call it is; a request no tool serves is answered in words."""
    client = _client(qwen)
    asked = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What's the weather in Oslo?"}], tools=[WEATHER, TIME],
        temperature=0)
    choice = asked.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Oslo"})]
    words = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a haiku about the sea."}], tools=[WEATHER, TIME],
        temperature=0)
    assert words.choices[0].finish_reason == "stop" and not words.choices[0].message.tool_calls
    assert len(words.choices[0].message.content.split()) >= 5


def test_parallel_calls_ask_for_both_cities(qwen: RunningServer) -> None:
    answer = _client(qwen).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What's the weather in Oslo and in Paris?"}],
        tools=[WEATHER], tool_choice="required", parallel_tool_calls=True, temperature=0)
    calls = answer.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_weather"]
    assert [json.loads(c.function.arguments)["city"] for c in calls] == ["Oslo", "Paris"]
    assert len({c.id for c in calls}) == 2


def test_a_streamed_call_assembles_from_its_deltas(qwen: RunningServer) -> None:
    stream = _client(qwen).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What's the weather in Oslo?"}], tools=[WEATHER],
        tool_choice="required", temperature=0, stream=True)
    names, arguments, finish = "", "", None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for part in delta.tool_calls or []:
            names += part.function.name or ""
            arguments += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert names == "get_weather" and json.loads(arguments) == {"city": "Oslo"} and finish == "tool_calls"


def test_the_responses_api_calls_the_tool(qwen: RunningServer) -> None:
    response = _client(qwen).responses.create(
        model=MODEL, input="What's the weather in Oslo?", temperature=0, tool_choice="required",
        tools=[{"type": "function", "name": "get_weather", "description": "Current weather in a city",
                "parameters": WEATHER["function"]["parameters"]}])  # type: ignore[index]
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo"}


def test_an_agent_with_a_tool_and_an_output_type_runs_to_its_final_output(qwen: RunningServer) -> None:
    """openai-agents on its default model (the Responses API): the agent calls its tool (forced on the first turn:
    under `auto` beside an output type this 1.5B model fills the output type at once, inventing the temperature;
    the SDK resets `tool_choice` after a call), reads the result, and ends with a value of its output type."""
    import asyncio

    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    class Report(BaseModel):
        city: str
        temperature_c: int

    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        cities.append(city)
        return f"It is sunny and 21 degrees Celsius in {city}."

    set_tracing_disabled(True)
    model = OpenAIResponsesModel(model=MODEL, openai_client=AsyncOpenAI(base_url=f"{qwen.base_url}/v1",
                                                                        api_key="unused", max_retries=0))
    agent = Agent(name="weather", model=model, tools=[get_weather], output_type=Report,
                  instructions="Use the tool, then report the city and its temperature.",
                  model_settings=ModelSettings(temperature=0, tool_choice="required"))
    result = asyncio.run(Runner.run(agent, "What's the weather in Oslo?", max_turns=4))
    assert cities == ["Oslo"]
    assert result.final_output == Report(city="Oslo", temperature_c=21)
