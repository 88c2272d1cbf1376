"""The client libraries people already use, each called as its own docs show, against a live corral.

Every structured answer must parse into the caller's pydantic model. The embedded default model is random,
so nothing here relies on it obeying a prompt: each test says what its library sends (checked on the wire
through a recording proxy) and which corral guarantee makes the answer parse:

- a JSON Schema (`response_format.json_schema`) or a function's `parameters` (`tools` + a forced
  `tool_choice`) is enforced token by token and validated before it is returned, so the value fits the model;
- `response_format: {"type": "json_object"}` guarantees a JSON object and nothing more (the schema travels
  only in the prompt text, if at all), so those tests parse into a model that accepts any object;
- a request with no constraint at all (Instructor's `MD_JSON`) leaves nothing to enforce: an expected failure.

Tool-based modes (Instructor `TOOLS`, LangChain `function_calling` and `bind_tools`, pydantic-ai's default
tool output) need corral's tool-call support (issue 9, item 1).

No library may reach past this machine: every test runs with outbound connections to anything but loopback
refused and recorded, and fails if any was attempted (LiteLLM reads its bundled model-cost map, LangSmith
tracing is off).
"""

from __future__ import annotations

import json
import os
from typing import Any, Literal

import client_wire
import pytest
from client_wire import Exchange, Recorder
from pydantic import BaseModel, ConfigDict, Field, SecretStr

# The shared proxy and network guard (tests/e2e/client_wire.py), as this module's fixtures.
proxy, wire, no_outside_network = client_wire.proxy, client_wire.wire, client_wire.no_outside_network

# Read at import time by the libraries (imported inside the tests, after the network guard is up).
os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
os.environ["LANGSMITH_TRACING"] = "false"
os.environ["LANGCHAIN_TRACING_V2"] = "false"

MODEL = os.environ.get("CORRAL_MODEL") or "corral-tiny"  # the served model (tests/conftest.py: corral-tiny)
PROMPT = "Describe a city."
MAX_TOKENS = 300
CONSTRAINT_FIELDS = ("response_format", "tools", "tool_choice", "structured_outputs")


class City(BaseModel):
    """What a caller's code declares: required fields, an enum, a bound and a bounded list."""

    name: str
    country: Literal["France", "Japan", "Peru"]
    population: int = Field(ge=0)
    districts: list[str] = Field(max_length=3)


class AnyObject(BaseModel):
    """The model for JSON mode: json_object promises a JSON object, not a schema, so every key is accepted."""

    model_config = ConfigDict(extra="allow")


# -- helpers --------------------------------------------------------------------------------------------------


def _assert_city_contract(city: object) -> City:
    assert isinstance(city, City), city
    assert city.population >= 0 and len(city.districts) <= 3
    return city


def _called_city(exchange: Exchange, name: str) -> dict[str, Any]:
    """The one tool call in corral's raw answer, its arguments validated as a City (dumped for comparison:
    libraries hand back their own subclasses of the caller's model)."""
    choice = exchange.response["choices"][0]
    calls = choice["message"].get("tool_calls") or []
    assert len(calls) == 1, choice
    assert choice["finish_reason"] == "tool_calls"
    assert calls[0]["type"] == "function" and calls[0]["function"]["name"] == name
    return City.model_validate_json(calls[0]["function"]["arguments"]).model_dump()


def _assert_json_object_answer(exchange: Exchange, parsed: AnyObject) -> None:
    assert exchange.request["response_format"] == {"type": "json_object"}
    assert exchange.response["grammar"]["kind"] == "json_object"
    assert parsed.model_extra == json.loads(exchange.response["choices"][0]["message"]["content"])


# -- Instructor -----------------------------------------------------------------------------------------------


def _instructor(wire: Recorder, mode: Any) -> Any:
    import instructor
    from openai import OpenAI

    return instructor.from_openai(OpenAI(base_url=wire.v1, api_key="unused", max_retries=0), mode=mode)


def test_instructor_tools(wire: Recorder) -> None:
    """Mode.TOOLS (Instructor's default) sends the model's schema as the one tool's `parameters` with
    `tool_choice` naming it; corral must answer that call, arguments generated under the schema."""
    import instructor

    client = _instructor(wire, instructor.Mode.TOOLS)
    city = client.chat.completions.create(
        model=MODEL, response_model=City, messages=[{"role": "user", "content": PROMPT}], max_tokens=MAX_TOKENS
    )
    _assert_city_contract(city)
    sent = wire.only()
    assert sent.request["tool_choice"] == {"type": "function", "function": {"name": "City"}}
    assert city.model_dump() == _called_city(sent, "City")


def test_instructor_json_schema(wire: Recorder) -> None:
    """Mode.JSON_SCHEMA sends `response_format.json_schema` with the model's schema: enforced by corral."""
    import instructor

    client = _instructor(wire, instructor.Mode.JSON_SCHEMA)
    city = client.chat.completions.create(
        model=MODEL, response_model=City, messages=[{"role": "user", "content": PROMPT}], max_tokens=MAX_TOKENS
    )
    _assert_city_contract(city)
    sent = wire.only()
    assert sent.request["response_format"]["type"] == "json_schema"
    assert sent.response["grammar"]["kind"] == "json_schema" and sent.response["grammar"]["schema_valid"] is True


def test_instructor_json(wire: Recorder) -> None:
    """Mode.JSON sends `response_format: json_object` and puts the schema in a system message only, so the
    server's guarantee is a JSON object (any keys); that object must reach the caller's model intact."""
    import instructor

    client = _instructor(wire, instructor.Mode.JSON)
    parsed = client.chat.completions.create(
        model=MODEL, response_model=AnyObject, messages=[{"role": "user", "content": PROMPT}], max_tokens=MAX_TOKENS
    )
    _assert_json_object_answer(wire.only(), parsed)


def test_instructor_md_json_sends_no_constraint(wire: Recorder) -> None:
    """Mode.MD_JSON only asks, in the prompt, for a ```json code block: the request carries no
    `response_format`, `tools` or `structured_outputs`, so no OpenAI-compatible server can enforce the shape,
    and it rests on the model obeying the prompt, which the random embedded model does not."""
    import instructor
    from instructor.core import InstructorRetryException

    client = _instructor(wire, instructor.Mode.MD_JSON)
    try:
        city = client.chat.completions.create(
            model=MODEL, response_model=City, messages=[{"role": "user", "content": PROMPT}],
            max_tokens=MAX_TOKENS, max_retries=0,
        )
    except InstructorRetryException:
        sent = wire.only().request
        assert not [name for name in CONSTRAINT_FIELDS if name in sent], sent
        pytest.xfail("Instructor MD_JSON sends no constraint (checked on the wire); a random model cannot obey")
    _assert_city_contract(city)


# -- LangChain ------------------------------------------------------------------------------------------------


def _chat_openai(wire: Recorder) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        base_url=wire.v1, api_key=SecretStr("unused"), model=MODEL, max_completion_tokens=MAX_TOKENS, max_retries=0
    )


def test_langchain_function_calling(wire: Recorder) -> None:
    """`with_structured_output(method="function_calling")` sends one tool, `tool_choice` naming it and
    `parallel_tool_calls: false`. With no tool call in the answer LangChain returns None, not an error."""
    city = _chat_openai(wire).with_structured_output(City, method="function_calling").invoke(PROMPT)
    _assert_city_contract(city)
    sent = wire.only()
    assert sent.request["tool_choice"] == {"type": "function", "function": {"name": "City"}}
    assert sent.request["parallel_tool_calls"] is False
    assert city.model_dump() == _called_city(sent, "City")


def test_langchain_json_schema(wire: Recorder) -> None:
    """`method="json_schema"` sends `response_format.json_schema` with `strict: true`: enforced by corral."""
    city = _chat_openai(wire).with_structured_output(City, method="json_schema").invoke(PROMPT)
    _assert_city_contract(city)
    sent = wire.only()
    assert sent.request["response_format"]["json_schema"]["strict"] is True
    assert sent.response["grammar"]["kind"] == "json_schema" and sent.response["grammar"]["schema_valid"] is True


def test_langchain_json_mode(wire: Recorder) -> None:
    """`method="json_mode"` sends `response_format: json_object` and no schema at all (LangChain's docs leave
    the format to the prompt), so corral guarantees a JSON object: it must parse into an any-object model."""
    parsed = _chat_openai(wire).with_structured_output(AnyObject, method="json_mode").invoke(PROMPT)
    assert isinstance(parsed, AnyObject)
    _assert_json_object_answer(wire.only(), parsed)


@pytest.mark.parametrize("tool_choice", ["any", "City"])
def test_langchain_bind_tools(wire: Recorder, tool_choice: str) -> None:
    """`bind_tools([City], tool_choice=...)`: "any" goes out as `"required"`, a name as a named choice; both
    force a call, so the AIMessage must carry exactly one tool call whose args fit the model. (Without
    `tool_choice` the model may answer in text instead; a random model's choice is nothing to assert.)"""
    from langchain_core.messages import AIMessage

    message = _chat_openai(wire).bind_tools([City], tool_choice=tool_choice).invoke(PROMPT)
    assert isinstance(message, AIMessage)
    assert len(message.tool_calls) == 1, message
    call = message.tool_calls[0]
    assert call["name"] == "City" and call["id"]
    city = _assert_city_contract(City.model_validate(call["args"]))
    sent = wire.only()
    assert city.model_dump() == _called_city(sent, "City")
    expected = "required" if tool_choice == "any" else {"type": "function", "function": {"name": "City"}}
    assert sent.request["tool_choice"] == expected


# -- pydantic-ai ----------------------------------------------------------------------------------------------


def test_pydantic_ai_default_tool_output(wire: Recorder) -> None:
    """`Agent(model, output_type=City)` uses its default ToolOutput: one `final_result` tool with
    `strict: true` and `tool_choice: "required"`. pydantic-ai also checks finish_reason against OpenAI's enum."""
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=wire.v1, api_key="unused"))
    agent = Agent(model, output_type=City)
    result = agent.run_sync(PROMPT, model_settings={"max_tokens": MAX_TOKENS})
    _assert_city_contract(result.output)
    sent = wire.only()
    assert sent.request["tool_choice"] == "required"
    assert [t["function"]["name"] for t in sent.request["tools"]] == ["final_result"]
    assert result.output.model_dump() == _called_city(sent, "final_result")


# -- LiteLLM --------------------------------------------------------------------------------------------------


def test_litellm_response_format_model(wire: Recorder) -> None:
    """`litellm.completion(response_format=City)` turns the model into `response_format.json_schema`
    (`strict: true`) for an `openai/` model: enforced by corral; the content parses into the model."""
    import litellm

    resp = litellm.completion(
        model=f"openai/{MODEL}", api_base=wire.v1, api_key="unused", response_format=City,
        messages=[{"role": "user", "content": PROMPT}], max_tokens=MAX_TOKENS,
    )
    assert resp.choices[0].finish_reason == "stop"
    _assert_city_contract(City.model_validate_json(resp.choices[0].message.content))
    sent = wire.only()
    assert sent.request["response_format"]["type"] == "json_schema"
    assert sent.response["grammar"]["kind"] == "json_schema" and sent.response["grammar"]["schema_valid"] is True
