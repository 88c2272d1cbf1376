"""The client libraries on the default model, qwen2.5-coder-1.5b-instruct, each driven as its docs show, and the
*values* checked: one extraction ("My neighbour Tomás Berg, 58, moved to Lisbon last year." → Tomás Berg, 58,
Lisbon) and one weather tool (`get_weather(city)`, asked for Oslo, answering "Sunny, 21 °C.").

tests/e2e/test_client_compat.py and test_agents_compat.py run the same libraries on corral-tiny, a random model,
so they prove the wire format only; here the model follows instructions, so the answer must be the right one.
Greedy (temperature 0) everywhere: each answer is the model's own, reproducibly. One server for the module, the
requests through the recording proxy of tests/e2e/client_wire.py (no library may reach past loopback), and no
library retries (`max_retries=0`): one request, one answer.

What this 1.5B model does, measured (tests/e2e/test_instruct_model.py has more): under `tool_choice: "auto"` it
writes its call as a ```json block, which corral returns as the call (docs/tools.md); after a tool's result it
answers in words only when a system message asks it to, and otherwise writes the call again.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from typing import Any

import client_wire
import pytest
from client_wire import Exchange, Recorder
from conftest import RunningServer, serving
from pydantic import BaseModel, SecretStr

# The shared proxy and network guard (tests/e2e/client_wire.py); the proxy fronts this module's `server` below.
proxy, wire, no_outside_network = client_wire.proxy, client_wire.wire, client_wire.no_outside_network

# Read at import time by the libraries (imported inside the tests, after the network guard is up).
os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
os.environ["LANGSMITH_TRACING"] = "false"
os.environ["LANGCHAIN_TRACING_V2"] = "false"

MODEL = "qwen2.5-coder-1.5b-instruct"
SENTENCE = "My neighbour Tomás Berg, 58, moved to Lisbon last year."
EXTRACT = f"Extract the person from this sentence as JSON: {SENTENCE}"
QUESTION = "What's the weather in Oslo?"
WEATHER_RESULT = "Sunny, 21 °C."
# This model answers a tool's result in words only when asked to (see the module's docstring).
ANSWER_AFTER_TOOLS = ("You are a helpful assistant. When a tool's result comes back, answer the user's question "
                      "in one sentence.")
MAX_TOKENS = 64  # an extraction is ~20 tokens, a call ~15, the final sentence ~20
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


class Person(BaseModel):
    name: str
    age: int
    city: str


EXPECTED = Person(name="Tomás Berg", age=58, city="Lisbon")


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    """The real instruct model for this module (the suite's shared `server` serves corral-tiny)."""
    with serving(model=MODEL) as running:
        yield running


# -- helpers --------------------------------------------------------------------------------------------------


def _person(value: Any) -> Person:
    """A library's answer as a plain Person (libraries hand back their own subclasses or dicts)."""
    return Person.model_validate(value.model_dump() if isinstance(value, BaseModel) else value)


def _calls(exchange: Exchange) -> list[tuple[str, dict[str, Any]]]:
    """(name, arguments) of every call in corral's raw chat answer."""
    calls = exchange.response["choices"][0]["message"].get("tool_calls") or []
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def _assert_weather_call(exchange: Exchange) -> None:
    assert exchange.status == 200, exchange.response
    assert exchange.response["choices"][0]["finish_reason"] == "tool_calls", exchange.response
    assert _calls(exchange) == [("get_weather", {"city": "Oslo"})]


def _assert_answered_in_words(text: Any) -> None:
    """The tool's result came back to the person as text, not JSON. Its wording is the model's: greedy answers
    differed with ggml's kernels ("It's sunny, 21 °C in Oslo." once, the result as it came, "Sunny, 21 °C.", since)."""
    assert isinstance(text, str), text
    assert "21" in text and not text.lstrip().startswith(("{", "[")), text


# -- Instructor -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA", "JSON", "MD_JSON"])
def test_instructor(wire: Recorder, mode: str) -> None:
    """Every mode: TOOLS (the default) forces one tool named Person; JSON_SCHEMA sends the schema as
    `response_format`; JSON sends `json_object` with the schema in a system message; MD_JSON sends no constraint
    and asks, in the prompt, for a ```json block, which this model writes."""
    import instructor
    from openai import OpenAI

    client = instructor.from_openai(OpenAI(base_url=wire.v1, api_key="unused", max_retries=0),
                                    mode=instructor.Mode[mode])
    person = client.chat.completions.create(
        model=MODEL, response_model=Person, messages=[{"role": "user", "content": EXTRACT}],
        max_tokens=MAX_TOKENS, temperature=0, max_retries=0)
    assert _person(person) == EXPECTED
    sent = wire.only().request
    constraint = {"TOOLS": sent.get("tool_choice"), "JSON_SCHEMA": (sent.get("response_format") or {}).get("type"),
                  "JSON": sent.get("response_format"), "MD_JSON": sent.get("response_format")}[mode]
    assert constraint == {"TOOLS": {"type": "function", "function": {"name": "Person"}}, "JSON_SCHEMA": "json_schema",
                          "JSON": {"type": "json_object"}, "MD_JSON": None}[mode]


# -- LangChain ------------------------------------------------------------------------------------------------


def _chat_openai(wire: Recorder, max_tokens: int = MAX_TOKENS) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=wire.v1, api_key=SecretStr("unused"), model=MODEL, temperature=0,
                      max_completion_tokens=max_tokens, max_retries=0)


def _langchain_weather_tool(cities: list[str]) -> Any:
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        cities.append(city)
        return WEATHER_RESULT

    return get_weather


@pytest.mark.parametrize("method", ["function_calling", "json_schema", "json_mode"])
def test_langchain_with_structured_output(wire: Recorder, method: str) -> None:
    """`with_structured_output(Person, method=...)`. json_mode sends `json_object` and no schema (LangChain's docs
    leave the keys to the prompt), so the prompt names them."""
    prompt = EXTRACT + (" Use the keys name, age and city." if method == "json_mode" else "")
    person = _chat_openai(wire).with_structured_output(Person, method=method).invoke(prompt)
    assert _person(person) == EXPECTED
    sent = wire.only()
    kind = {"function_calling": "tool_calls", "json_schema": "json_schema", "json_mode": "json_object"}[method]
    assert sent.response["grammar"]["kind"] == kind, sent.response


@pytest.mark.parametrize("tool_choice", ["any", "get_weather"])
def test_langchain_bind_tools_forced(wire: Recorder, tool_choice: str) -> None:
    """`bind_tools([get_weather], tool_choice=...)`: "any" goes out as `required`, a name as a named choice."""
    message = _chat_openai(wire).bind_tools([_langchain_weather_tool([])], tool_choice=tool_choice).invoke(QUESTION)
    assert [(call["name"], call["args"]) for call in message.tool_calls] == [("get_weather", {"city": "Oslo"})]
    _assert_weather_call(wire.only())


def test_langchain_agent_loop(wire: Recorder) -> None:
    """LangChain's tool-calling loop as its docs show: the model calls the tool (`auto`), the tool runs on the
    call (`tool.invoke(tool_call)` gives the ToolMessage), and the model answers in words."""
    from langchain_core.messages import HumanMessage, SystemMessage

    cities: list[str] = []
    get_weather = _langchain_weather_tool(cities)
    llm = _chat_openai(wire).bind_tools([get_weather])
    messages: list[Any] = [SystemMessage(ANSWER_AFTER_TOOLS), HumanMessage(QUESTION)]
    called = llm.invoke(messages)
    messages.append(called)
    messages.extend(get_weather.invoke(call) for call in called.tool_calls)
    answer = llm.invoke(messages)
    assert cities == ["Oslo"]
    assert not answer.tool_calls
    _assert_answered_in_words(answer.content)
    first, second = wire.exchanges
    _assert_weather_call(first)
    assert second.response["choices"][0]["finish_reason"] == "stop"


# -- pydantic-ai ----------------------------------------------------------------------------------------------


def _pydantic_ai_model(wire: Recorder) -> Any:
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    return OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=wire.v1, api_key="unused"))


SETTINGS: dict[str, Any] = {"temperature": 0, "max_tokens": MAX_TOKENS}


@pytest.mark.parametrize("output", ["tool", "native"])
def test_pydantic_ai_output(wire: Recorder, output: str) -> None:
    """`Agent(output_type=...)`: the default ToolOutput (one `final_result` tool under `required`) and NativeOutput
    (the schema as `response_format`), both enforced by corral."""
    from pydantic_ai import Agent, NativeOutput

    output_type: Any = {"tool": Person, "native": NativeOutput(Person)}[output]
    agent = Agent(_pydantic_ai_model(wire), output_type=output_type, retries=0)
    result = agent.run_sync(EXTRACT, model_settings=SETTINGS)
    assert _person(result.output) == EXPECTED
    sent = wire.only()
    kind = {"tool": "tool_calls", "native": "json_schema"}[output]
    assert sent.response["grammar"]["kind"] == kind, sent.response


def test_pydantic_ai_prompted_output_is_json_the_library_reads(wire: Recorder) -> None:
    """PromptedOutput puts the schema in the instructions and asks for `json_object`: corral holds the answer to
    JSON (closing it if the budget runs out) and the library reads it. Which JSON this 1.5B model writes depends
    on rounding (measured: with the float16 weights and the file's Q4_K blocks it writes the schema back; the same
    blocks repacked for AVX2's kernels filled it in), so the person is checked only when the model gave one."""
    from pydantic_ai import Agent, PromptedOutput
    from pydantic_ai.exceptions import UnexpectedModelBehavior

    agent = Agent(_pydantic_ai_model(wire), output_type=PromptedOutput(Person), retries=0)
    try:
        output: Any = agent.run_sync(EXTRACT, model_settings=SETTINGS).output
    except UnexpectedModelBehavior:
        output = None
    sent = wire.only()
    assert sent.status == 200 and sent.request["response_format"] == {"type": "json_object"}
    assert sent.response["grammar"]["kind"] == "json_object" and sent.response["grammar"]["valid"], sent.response
    (choice,) = sent.response["choices"]
    answer = json.loads(choice["message"]["content"])  # JSON whether the model finished it or corral closed it
    if output is not None:
        assert _person(output) == EXPECTED
    else:  # the model wrote other JSON than a person: pydantic-ai's validation refused it
        assert isinstance(answer, dict) and set(answer) != {"name", "age", "city"}


def test_pydantic_ai_tool_calling_agent(wire: Recorder) -> None:
    """An agent with a tool and a text output: the model calls the tool (`auto`), reads its result, answers."""
    from pydantic_ai import Agent

    cities: list[str] = []
    agent = Agent(_pydantic_ai_model(wire), system_prompt=ANSWER_AFTER_TOOLS, retries=0)

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        cities.append(city)
        return WEATHER_RESULT

    result = agent.run_sync(QUESTION, model_settings=SETTINGS)
    assert cities == ["Oslo"]
    _assert_answered_in_words(result.output)
    first, second = wire.exchanges
    _assert_weather_call(first)
    assert second.response["choices"][0]["finish_reason"] == "stop"


# -- LiteLLM --------------------------------------------------------------------------------------------------


def test_litellm_response_format(wire: Recorder) -> None:
    import litellm

    answer = litellm.completion(
        model=f"openai/{MODEL}", api_base=wire.v1, api_key="unused", response_format=Person,
        messages=[{"role": "user", "content": EXTRACT}], max_tokens=MAX_TOKENS, temperature=0)
    assert answer.choices[0].finish_reason == "stop"
    assert Person.model_validate_json(answer.choices[0].message.content) == EXPECTED
    assert wire.only().response["grammar"]["kind"] == "json_schema"


def test_litellm_tools(wire: Recorder) -> None:
    """`tools` with `tool_choice: "auto"` (LiteLLM's docs' example): the model writes its call as JSON text, which
    comes back as the call."""
    import litellm

    answer = litellm.completion(
        model=f"openai/{MODEL}", api_base=wire.v1, api_key="unused", tools=[WEATHER], tool_choice="auto",
        messages=[{"role": "user", "content": QUESTION}], max_tokens=MAX_TOKENS, temperature=0)
    assert answer.choices[0].finish_reason == "tool_calls"
    calls = answer.choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    _assert_weather_call(wire.only())


# -- openai-agents --------------------------------------------------------------------------------------------


def test_openai_agents_forced_tool_then_output_type(wire: Recorder) -> None:
    """The Agents SDK on its Chat Completions model (tests/e2e/test_instruct_model.py runs the Responses model):
    the first turn forced (`required`: under `auto` beside an output type this model fills the output type at
    once, inventing the temperature), the tool runs, the SDK resets `tool_choice` and the answer is a Report."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
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
    model = OpenAIChatCompletionsModel(MODEL, openai_client=AsyncOpenAI(base_url=wire.v1, api_key="unused",
                                                                         max_retries=0))
    agent = Agent(name="weather", model=model, tools=[get_weather], output_type=Report,
                  instructions="Use the tool, then report the city and its temperature.",
                  model_settings=ModelSettings(temperature=0, tool_choice="required", max_tokens=MAX_TOKENS))
    result = asyncio.run(Runner.run(agent, QUESTION, max_turns=4))
    assert cities == ["Oslo"]
    assert result.final_output == Report(city="Oslo", temperature_c=21)
    first, *rest = wire.exchanges
    _assert_weather_call(first)
    assert rest and all(t.request.get("tool_choice") in (None, "auto") for t in rest), [t.request for t in rest]


# -- llama-index ----------------------------------------------------------------------------------------------


def test_llama_index_structured_predict(wire: Recorder) -> None:
    """llama-index's `OpenAILike` (any OpenAI-compatible server) and `structured_predict`, as its docs show."""
    pytest.importorskip("llama_index.llms.openai_like",
                        reason="llama-index (llama-index-llms-openai-like) is not installed in this environment; "
                               "it is not among the dev extra's client libraries")
    from llama_index.core.prompts import PromptTemplate
    from llama_index.llms.openai_like import OpenAILike

    llm = OpenAILike(model=MODEL, api_base=wire.v1, api_key="unused", is_chat_model=True,
                     is_function_calling_model=True, temperature=0, max_tokens=MAX_TOKENS, max_retries=0)
    person = llm.structured_predict(Person, PromptTemplate("Extract the person from this sentence: {text}"),
                                    text=SENTENCE)
    assert _person(person) == EXPECTED
