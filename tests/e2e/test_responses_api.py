"""`POST /v1/responses` (OpenAI's Responses API) through the official SDK against a live corral on the tiny
random model: body shape and usage, `text.format` (json_schema through `responses.parse`, json_object),
function tools under each forced `tool_choice`, a second turn carrying `function_call` and
`function_call_output` items, budget cuts (closed early unless `close_answers: false`), the streaming event
sequence (text and function-call arguments), the fields corral refuses with a 400 naming them, and the
forced tool call together with a format (on this API and on chat completions).

corral-tiny follows no prompt, so every assertion rests on what a constraint guarantees: a value valid under
its schema, a call valid under its function's `parameters`, and honest statuses; never on the content.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from conftest import RunningServer
from test_answer_closing import ORDER  # answers that run past a small budget
from test_sdk_parse import SCHEMA as PERSON_SCHEMA
from test_sdk_parse import Person
from test_tools import WEATHER

MODEL = "corral-tiny"
PROMPT = "Describe a person."
MESSAGES: list[Any] = [{"role": "user", "content": PROMPT}]

PERSON_FORMAT: dict[str, Any] = {"type": "json_schema", "name": "person", "schema": PERSON_SCHEMA, "strict": True}

ORDER_FORMAT: dict[str, Any] = {"type": "json_schema", "name": "order", "schema": ORDER, "strict": True}

TIME: dict[str, Any] = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
# Responses-API function tools: flat (`name`, `parameters` beside `type`), not chat's nested `function`.
TOOLS: list[Any] = [
    {"type": "function", "name": "get_weather", "description": "Forecast", "parameters": WEATHER, "strict": True},
    {"type": "function", "name": "get_time", "description": "Clock", "parameters": TIME, "strict": True},
]
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}
TOOL_QUESTION = "What is the weather in Oslo?"


# -- helpers --------------------------------------------------------------------------------------------------


def create(client: openai.OpenAI, **kwargs: Any) -> Any:
    """`client.responses.create` with the test defaults: the served model, a fixed seed (a corral extension,
    sent in the body) and a budget that fits every answer here unless a test says otherwise."""
    kwargs.setdefault("input", PROMPT)
    kwargs.setdefault("max_output_tokens", 300)
    extra = dict(kwargs.pop("extra_body", None) or {})
    extra.setdefault("seed", 0)
    return client.responses.create(model=MODEL, extra_body=extra, **kwargs)


def extras(resp: Any) -> dict[str, Any]:
    """corral's own top-level keys (`grammar`, `timings`, `corral_finish_reason`), kept by the SDK."""
    return dict(resp.model_extra or {})


def assert_usage(resp: Any) -> None:
    usage = resp.usage
    assert usage is not None, resp
    assert usage.input_tokens > 0
    assert usage.output_tokens >= 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens >= 0
    assert usage.output_tokens_details.reasoning_tokens == 0


def the_message(resp: Any) -> Any:
    """The response's one output item, a message with one `output_text` part (checked)."""
    assert [item.type for item in resp.output] == ["message"], resp.output
    message = resp.output[0]
    assert message.id.startswith("msg_") and message.role == "assistant"
    assert [part.type for part in message.content] == ["output_text"], message
    assert message.content[0].annotations == []
    assert resp.output_text == message.content[0].text
    return message


def valid_calls(resp: Any, schemas: dict[str, Any] = SCHEMAS) -> list[Any]:
    """The response's output: function calls only, at least one, each valid under its function's schema."""
    calls = list(resp.output)
    assert calls and all(item.type == "function_call" for item in calls), resp.output
    for call in calls:
        assert call.id.startswith("fc_") and call.call_id.startswith("call_"), call
        assert call.status == "completed"
        assert call.name in schemas, call
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    assert len({call.call_id for call in calls}) == len(calls)
    assert resp.status == "completed" and resp.incomplete_details is None
    assert extras(resp)["corral_finish_reason"] == "tool_calls"
    return calls


@pytest.fixture()
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


def post(http: httpx.Client, **fields: Any) -> httpx.Response:
    body = {"model": MODEL, "input": PROMPT, "max_output_tokens": 16, **fields}
    return http.post("/v1/responses", json=body)


# -- plain text -----------------------------------------------------------------------------------------------


def test_string_input_body_shape(client: openai.OpenAI) -> None:
    resp = create(client, max_output_tokens=16, temperature=0.7, top_p=0.9)
    assert resp.id.startswith("resp_") and resp.object == "response"
    assert isinstance(resp.created_at, (int, float)) and resp.created_at > 0
    assert resp.model == MODEL
    assert resp.error is None
    message = the_message(resp)
    # Unconstrained: the random model either ends by itself or the budget cuts it; either is reported as such.
    if resp.status == "completed":
        assert resp.incomplete_details is None and message.status == "completed"
        assert extras(resp)["corral_finish_reason"] == "stop"
    else:
        assert resp.status == "incomplete", resp
        assert resp.incomplete_details.reason == "max_output_tokens" and message.status == "incomplete"
        assert resp.usage.output_tokens == 16
    assert_usage(resp)
    assert resp.usage.output_tokens <= 16
    # The request's settings, echoed as OpenAI echoes them.
    assert resp.max_output_tokens == 16
    assert resp.temperature == 0.7 and resp.top_p == 0.9
    assert resp.tools == [] and resp.instructions is None
    assert resp.text.format.type == "text"
    assert isinstance(extras(resp)["timings"], dict)
    assert "grammar" in extras(resp)


def test_raw_body_has_every_documented_key(http: httpx.Client) -> None:
    answer = post(http, seed=0)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    expected = {"id", "object", "created_at", "status", "error", "incomplete_details", "model", "output", "usage",
                "text", "tools", "tool_choice", "parallel_tool_calls", "temperature", "top_p", "max_output_tokens",
                "instructions", "corral_finish_reason", "grammar", "timings"}
    assert expected <= body.keys(), expected - body.keys()
    assert isinstance(body["created_at"], int)
    assert set(body["usage"]) >= {"input_tokens", "input_tokens_details", "output_tokens",
                                  "output_tokens_details", "total_tokens"}
    assert body["output"][0]["type"] == "message"
    assert body["output"][0]["content"][0] == {
        "type": "output_text", "text": body["output"][0]["content"][0]["text"], "annotations": [], "logprobs": []}
    assert answer.headers["content-type"].startswith("application/json")


def test_string_input_counts_as_one_user_message(client: openai.OpenAI) -> None:
    """A string `input` is one user message: the prompt is the one chat completions renders for it."""
    resp = create(client, max_output_tokens=8)
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, seed=0)
    assert chat.usage is not None
    assert resp.usage.input_tokens == chat.usage.prompt_tokens


def test_instructions_are_accepted(client: openai.OpenAI) -> None:
    plain = create(client, max_output_tokens=8)
    told = create(client, max_output_tokens=8, instructions="You are terse. Answer in one word.")
    assert told.status != "failed" and told.instructions == "You are terse. Answer in one word."
    assert told.usage.input_tokens > plain.usage.input_tokens  # the instructions reached the prompt
    the_message(told)


@pytest.mark.parametrize("typed", [False, True], ids=["bare", "type-message"])
def test_input_as_message_items(client: openai.OpenAI, typed: bool) -> None:
    items: list[Any] = [
        {"role": "system", "content": "You describe people."},
        {"role": "developer", "content": [{"type": "input_text", "text": "Keep it short."}]},
        {"role": "user", "content": "Describe Ann."},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Ann is tall."}]},
        {"role": "user", "content": [{"type": "input_text", "text": PROMPT}]},
    ]
    if typed:
        items = [{"type": "message", **item} for item in items]
    resp = create(client, input=items, max_output_tokens=8)
    assert resp.status in ("completed", "incomplete"), resp
    the_message(resp)
    assert resp.usage.input_tokens > create(client, max_output_tokens=8).usage.input_tokens


# -- text.format ----------------------------------------------------------------------------------------------


def test_parse_returns_the_pydantic_object(client: openai.OpenAI) -> None:
    resp = client.responses.parse(model=MODEL, input=PROMPT, text_format=Person, max_output_tokens=300,
                                  extra_body={"seed": 0})
    assert resp.status == "completed", (resp.status, resp.incomplete_details, extras(resp))
    assert isinstance(resp.output_parsed, Person)
    assert resp.output_parsed == Person.model_validate_json(resp.output_text)
    assert the_message(resp).status == "completed"
    assert resp.text.format.type == "json_schema" and resp.text.format.name == "Person"
    grammar = extras(resp)["grammar"]
    assert grammar["kind"] == "json_schema" and grammar["valid"] is True and grammar["schema_valid"] is True
    assert extras(resp)["corral_finish_reason"] == "stop"
    assert_usage(resp)


def test_json_schema_format(client: openai.OpenAI) -> None:
    resp = create(client, text={"format": PERSON_FORMAT})
    assert resp.status == "completed", (resp.status, resp.incomplete_details, extras(resp))
    jsonschema.validate(json.loads(the_message(resp).content[0].text), PERSON_SCHEMA)
    assert resp.text.format.type == "json_schema" and resp.text.format.name == "person"


def test_json_object_format(client: openai.OpenAI) -> None:
    resp = create(client, text={"format": {"type": "json_object"}}, max_output_tokens=200)
    assert resp.status == "completed", (resp.status, resp.incomplete_details, extras(resp))
    assert isinstance(json.loads(the_message(resp).content[0].text), dict)
    assert extras(resp)["grammar"]["kind"] == "json_object"
    assert resp.text.format.type == "json_object"


@pytest.mark.parametrize("max_output_tokens", [16, 24])
def test_a_budget_cut_schema_answer_is_incomplete_and_closed(client: openai.OpenAI, max_output_tokens: int) -> None:
    resp = create(client, text={"format": ORDER_FORMAT}, max_output_tokens=max_output_tokens, temperature=0)
    assert resp.status == "incomplete", (resp.status, extras(resp))
    assert resp.incomplete_details.reason == "max_output_tokens"
    message = the_message(resp)
    assert message.status == "incomplete"
    jsonschema.validate(json.loads(message.content[0].text), ORDER)  # closed early: still a valid order
    grammar = extras(resp)["grammar"]
    assert grammar["closed"] == "budget" and grammar["valid"] is True
    assert extras(resp)["corral_finish_reason"] == "closed"
    assert resp.usage.output_tokens <= max_output_tokens
    assert_usage(resp)


def test_close_answers_false_leaves_the_cut_answer_open(client: openai.OpenAI) -> None:
    resp = create(client, text={"format": ORDER_FORMAT}, max_output_tokens=16, temperature=0,
                  extra_body={"close_answers": False})
    assert resp.status == "incomplete", (resp.status, extras(resp))
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert the_message(resp).status == "incomplete"
    grammar = extras(resp)["grammar"]
    assert grammar["closed"] is None and grammar["valid"] is False
    assert extras(resp)["corral_finish_reason"] == "length"
    assert resp.usage.output_tokens == 16


# An answer xgrammar lets through that breaks the full schema: xgrammar reads this oneOf as anyOf, so "1" passes
# its grammar though it matches both branches; "2" is valid (tests/e2e/test_finish_reasons.py uses the same one).
ONE_OF: dict[str, Any] = {"oneOf": [{"const": 1}, {"enum": [1, 2]}]}
ONE_OF_BODY: dict[str, Any] = {"input": "Answer.", "max_output_tokens": 20, "max_revisions": 0,
                               "structured_outputs": {"json": ONE_OF, "backend": "xgrammar"}}


def test_a_failed_constraint_is_never_completed(http: httpx.Client) -> None:
    """Over a few seeds the random model answers "1" (invalid under the full schema) or "2" (valid): every
    invalid answer is reported as such (not `completed`), every valid one as completed."""
    seen = set()
    for seed in range(12):
        answer = post(http, **ONE_OF_BODY, seed=seed)
        assert answer.status_code == 200, answer.text
        body = answer.json()
        text = body["output"][0]["content"][0]["text"]
        seen.add(text)
        if text == "2":
            assert body["status"] == "completed" and body["corral_finish_reason"] == "stop", body
            continue
        assert text == "1", body
        assert body["status"] in ("incomplete", "failed"), body
        assert body["corral_finish_reason"] == "invalid_output"
        assert body["grammar"]["valid"] is False and body["grammar"]["validation_error"]
        if body["status"] == "incomplete":
            assert body["incomplete_details"] == {"reason": "content_filter"}, body
            assert body["output"][0]["status"] == "incomplete"
        else:
            assert body["error"] and body["error"]["message"], body
    assert "1" in seen, f"no seed gave the invalid answer; seen {seen}"


def test_a_streamed_failed_constraint_does_not_end_completed(http: httpx.Client) -> None:
    for seed in range(12):
        if post(http, **ONE_OF_BODY, seed=seed).json()["output"][0]["content"][0]["text"] == "1":
            break
    else:
        pytest.fail("no seed gave the invalid answer")
    with http.stream("POST", "/v1/responses",
                     json={"model": MODEL, **ONE_OF_BODY, "seed": seed, "stream": True}) as answer:
        assert answer.status_code == 200
        data = [json.loads(line[len("data: "):]) for line in answer.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]
    assert [d["type"] for d in data][-1] in ("response.incomplete", "response.failed"), [d["type"] for d in data]
    final = data[-1]["response"]
    assert final["status"] != "completed" and final["corral_finish_reason"] == "invalid_output", final


# -- function tools -------------------------------------------------------------------------------------------


def test_required_tool_choice_gives_valid_calls(client: openai.OpenAI) -> None:
    resp = create(client, input=TOOL_QUESTION, tools=TOOLS, tool_choice="required")
    valid_calls(resp)
    assert resp.tool_choice == "required"
    assert [t.name for t in resp.tools] == ["get_weather", "get_time"]
    grammar = extras(resp)["grammar"]
    assert grammar["kind"] == "tool_calls" and grammar["valid"] is True
    assert_usage(resp)


def test_named_function_is_the_only_one_called(client: openai.OpenAI) -> None:
    resp = create(client, input=TOOL_QUESTION, tools=TOOLS, tool_choice={"type": "function", "name": "get_time"})
    assert {call.name for call in valid_calls(resp)} == {"get_time"}


def test_parallel_off_gives_exactly_one_call(client: openai.OpenAI) -> None:
    resp = create(client, input=TOOL_QUESTION, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert len(valid_calls(resp)) == 1
    assert resp.parallel_tool_calls is False


def test_none_generates_no_call(client: openai.OpenAI) -> None:
    resp = create(client, input=TOOL_QUESTION, tools=TOOLS, tool_choice="none", max_output_tokens=16)
    the_message(resp)


def test_auto_with_a_format_constrains_whichever_branch(client: openai.OpenAI) -> None:
    """Under `auto` the model may call or answer; a call fits its function, an answer fits the format."""
    resp = create(client, input=TOOL_QUESTION, tools=TOOLS, tool_choice="auto", text={"format": PERSON_FORMAT})
    if any(item.type == "function_call" for item in resp.output):
        valid_calls(resp)
    else:
        assert resp.status == "completed", (resp.status, extras(resp))
        jsonschema.validate(json.loads(the_message(resp).content[0].text), PERSON_SCHEMA)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}],
                         ids=["required", "named"])
def test_forced_call_with_a_text_format_is_accepted(client: openai.OpenAI, tool_choice: Any) -> None:
    """A forced call and a `text.format` together: the call is generated under the function's parameters
    (the format is for text, which a forced turn does not produce)."""
    resp = create(client, input=TOOL_QUESTION, tools=TOOLS, tool_choice=tool_choice, text={"format": PERSON_FORMAT})
    calls = valid_calls(resp)
    if isinstance(tool_choice, dict):
        assert {call.name for call in calls} == {"get_weather"}
    assert resp.text.format.type == "json_schema"


def _tool_outputs(calls: list[Any]) -> list[Any]:
    return [{"type": "function_call_output", "call_id": c.call_id, "output": '{"forecast": "rain"}'} for c in calls]


def test_second_turn_with_function_call_items(client: openai.OpenAI) -> None:
    question: list[Any] = [{"role": "user", "content": TOOL_QUESTION}]
    first = create(client, input=question, tools=TOOLS, tool_choice="required")
    calls = valid_calls(first)
    history = [
        *question,
        *[{"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments} for c in calls],
        *_tool_outputs(calls),
    ]
    again = create(client, input=history, tools=TOOLS, tool_choice="required")
    valid_calls(again)
    assert again.usage.input_tokens > first.usage.input_tokens  # the calls and their results reached the prompt
    answer = create(client, input=history, tools=TOOLS, tool_choice="none", max_output_tokens=16)
    the_message(answer)
    formatted = create(client, input=history, tools=TOOLS, tool_choice="none", text={"format": PERSON_FORMAT})
    assert formatted.status == "completed", (formatted.status, extras(formatted))
    jsonschema.validate(json.loads(the_message(formatted).content[0].text), PERSON_SCHEMA)


def test_second_turn_sending_the_output_items_back(client: openai.OpenAI) -> None:
    """OpenAI's function-calling guide appends `response.output` itself (items with `id` and `status`) to the
    next input, then one `function_call_output` per call."""
    history: list[Any] = [{"role": "user", "content": TOOL_QUESTION}]
    first = create(client, input=history, tools=TOOLS, tool_choice="required")
    calls = valid_calls(first)
    history += first.output
    history += _tool_outputs(calls)
    again = create(client, input=history, tools=TOOLS, tool_choice="required")
    valid_calls(again)
    # A text answer sent back the same way (a message item with `id`, `status`, annotations) is accepted too.
    text = create(client, input=[*history, *again.output, *_tool_outputs(list(again.output))], tools=TOOLS,
                  tool_choice="none", max_output_tokens=8)
    the_message(text)
    last = create(client, input=[*history, *again.output, *_tool_outputs(list(again.output)), *text.output,
                                 {"role": "user", "content": "Thanks."}], max_output_tokens=8)
    the_message(last)


# -- streaming ------------------------------------------------------------------------------------------------


def _assert_sequence_numbers(events: list[Any]) -> None:
    numbers = [event.sequence_number for event in events]
    assert all(a < b for a, b in itertools.pairwise(numbers)), numbers


def _types(events: list[Any]) -> str:
    return " ".join(event.type for event in events)


TEXT_ITEM = (r"response\.output_item\.added response\.content_part\.added( response\.output_text\.delta)+"
             r" response\.output_text\.done response\.content_part\.done response\.output_item\.done")
CALL_ITEM = (r"response\.output_item\.added( response\.function_call_arguments\.delta)+"
             r" response\.function_call_arguments\.done response\.output_item\.done")


def test_stream_helper_with_text_format(client: openai.OpenAI) -> None:
    with client.responses.stream(model=MODEL, input=PROMPT, text_format=Person, max_output_tokens=300,
                                 extra_body={"seed": 0}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = _types(events)
    assert re.fullmatch(rf"response\.created response\.in_progress {TEXT_ITEM} response\.completed", types), types
    _assert_sequence_numbers(events)
    created, completed = events[0].response, events[-1].response
    assert created.id == completed.id == final.id and created.id.startswith("resp_")
    assert created.status == "in_progress" and created.output == []
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == deltas == final.output_text
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.output[0].id}
    assert final.status == "completed"
    assert isinstance(final.output_parsed, Person)
    assert isinstance(done.parsed, Person)
    assert_usage(final)
    assert final.usage.output_tokens > 0
    assert isinstance(extras(final).get("grammar"), dict) and extras(final)["grammar"]["valid"] is True
    # Same seed, not streamed: the same answer.
    whole = client.responses.parse(model=MODEL, input=PROMPT, text_format=Person, max_output_tokens=300,
                                   extra_body={"seed": 0})
    assert whole.output_text == final.output_text
    assert whole.usage is not None and whole.usage.output_tokens == final.usage.output_tokens


@pytest.mark.parametrize("tool_choice", [{"type": "function", "name": "get_weather"}, "required"],
                         ids=["named", "required"])
def test_stream_function_call_arguments(client: openai.OpenAI, tool_choice: Any) -> None:
    events = list(create(client, input=TOOL_QUESTION, tools=TOOLS, tool_choice=tool_choice, stream=True))
    types = _types(events)
    assert re.fullmatch(rf"response\.created response\.in_progress( {CALL_ITEM})+ response\.completed", types), types
    _assert_sequence_numbers(events)
    final = events[-1].response
    calls = valid_calls(final)
    for index, call in enumerate(calls):
        added = next(e for e in events if e.type == "response.output_item.added" and e.output_index == index)
        assert added.item.type == "function_call" and added.item.id == call.id and added.item.name == call.name
        assert added.item.call_id == call.call_id
        deltas = [e for e in events if e.type == "response.function_call_arguments.delta" and e.output_index == index]
        assert deltas  # one or more pieces (grammar-forced runs of tokens may arrive together)
        assert all(e.item_id == call.id for e in deltas)
        done = next(e for e in events if e.type == "response.function_call_arguments.done" and e.output_index == index)
        assert "".join(e.delta for e in deltas) == done.arguments == call.arguments
        item_done = next(e for e in events if e.type == "response.output_item.done" and e.output_index == index)
        assert item_done.item.arguments == call.arguments and item_done.item.status == "completed"
    if isinstance(tool_choice, dict):
        assert {call.name for call in calls} == {"get_weather"}
    # Same seed, not streamed: the same calls.
    whole = create(client, input=TOOL_QUESTION, tools=TOOLS, tool_choice=tool_choice)
    assert [(c.name, c.arguments) for c in valid_calls(whole)] == [(c.name, c.arguments) for c in calls]


def test_stream_helper_with_a_forced_call(client: openai.OpenAI) -> None:
    with client.responses.stream(model=MODEL, input=TOOL_QUESTION, tools=TOOLS, max_output_tokens=300,
                                 tool_choice={"type": "function", "name": "get_time"},
                                 extra_body={"seed": 0}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    snapshots = [e.snapshot for e in events if e.type == "response.function_call_arguments.delta"]
    calls = valid_calls(final)
    assert snapshots and snapshots[-1] == calls[0].arguments


def test_stream_of_a_cut_answer_ends_incomplete(client: openai.OpenAI) -> None:
    events = list(create(client, text={"format": ORDER_FORMAT}, max_output_tokens=16, temperature=0, stream=True))
    types = _types(events)
    assert re.fullmatch(rf"response\.created response\.in_progress {TEXT_ITEM} response\.incomplete", types), types
    _assert_sequence_numbers(events)
    final = events[-1].response
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.output[0].content[0].text == text
    jsonschema.validate(json.loads(text), ORDER)
    assert (final.model_extra or {})["grammar"]["closed"] == "budget"


def test_stream_raw_sse_lines(http: httpx.Client) -> None:
    """On the wire: `event:`/`data:` pairs whose `data` is a JSON object carrying the same `type`."""
    with http.stream("POST", "/v1/responses", json={"model": MODEL, "input": PROMPT, "max_output_tokens": 8,
                                                      "stream": True, "seed": 0}) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in answer.iter_lines() if line]
    data = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]
    assert data[0]["type"] == "response.created" and data[-1]["type"] in ("response.completed", "response.incomplete")
    named = [line[len("event: "):] for line in lines if line.startswith("event: ")]
    if named:  # OpenAI names each event; the SDK reads `data.type` either way
        assert named == [d["type"] for d in data]


# -- refused and unknown fields ------------------------------------------------------------------------------


def _error(answer: httpx.Response) -> dict[str, Any]:
    assert answer.status_code == 400, (answer.status_code, answer.text)
    error = answer.json()["error"]
    assert {"message", "type", "param", "code"} <= error.keys(), error
    assert isinstance(error["message"], str) and error["message"]
    return dict(error)


@pytest.mark.parametrize(("fields", "param"), [
    ({"previous_response_id": "resp_0123456789"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"background": True}, "background"),
    ({"conversation": "conv_0123456789"}, "conversation"),
    ({"conversation": {"id": "conv_0123456789"}}, "conversation"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"include": ["reasoning.encrypted_content"]}, "include[0]"),
], ids=lambda value: value if isinstance(value, str) else None)
def test_refused_field_is_a_400_naming_it(http: httpx.Client, fields: dict[str, Any], param: str) -> None:
    error = _error(post(http, **fields))
    assert error["param"] == param or str(error["param"]).startswith(f"{param}."), error


@pytest.mark.parametrize("tool", [{"type": "web_search"}, {"type": "file_search", "vector_store_ids": ["vs_1"]},
                                  {"type": "code_interpreter", "container": {"type": "auto"}}],
                         ids=lambda tool: tool["type"])
def test_hosted_tool_is_a_400_naming_it(http: httpx.Client, tool: dict[str, Any]) -> None:
    error = _error(post(http, tools=[TOOLS[0], tool]))
    assert str(error["param"]).startswith("tools[1]"), error  # the hosted tool's place in `tools`


def test_input_image_is_a_400_naming_the_part(http: httpx.Client) -> None:
    content = [{"type": "input_text", "text": "What is this?"},
               {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}]
    error = _error(post(http, input=[{"role": "user", "content": content}]))
    assert str(error["param"]).startswith("input[0].content[1]"), error


def test_unknown_field_is_a_400(http: httpx.Client) -> None:
    error = _error(post(http, temprature=0.5))
    assert error["param"] == "temprature" and error["code"] == "unknown_parameter", error


def test_sdk_raises_bad_request_with_the_param(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        create(client, previous_response_id="resp_0123456789")
    assert caught.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_harmless_defaults_are_accepted(http: httpx.Client) -> None:
    """What SDKs and agent frameworks send by default: `include: []`, `store: false`, `background: false`,
    `parallel_tool_calls` without tools."""
    answer = post(http, include=[], store=False, background=False, parallel_tool_calls=True, seed=0)
    assert answer.status_code == 200, answer.text
    assert answer.json()["status"] in ("completed", "incomplete")


def test_an_empty_tools_list_is_accepted(http: httpx.Client) -> None:
    """The Agents SDK sends `tools: []` for every agent without tools (OpenAI accepts it): no tools."""
    answer = post(http, tools=[], include=[], seed=0)
    assert answer.status_code == 200, answer.text
    assert answer.json()["tools"] == [] and answer.json()["output"][0]["type"] == "message"


def test_wrong_model_is_a_404(http: httpx.Client) -> None:
    answer = post(http, model="gpt-4o")
    assert answer.status_code == 404, answer.text
    assert answer.json()["error"]["code"] == "model_not_found"


# -- chat completions: a forced call with a response_format --------------------------------------------------

CHAT_TOOLS: list[Any] = [
    {"type": "function",
     "function": {"name": t["name"], "description": t["description"], "parameters": t["parameters"]}}
    for t in TOOLS
]


@pytest.mark.parametrize(("tool_choice", "response_format"), [
    ("required", {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}}),
    ("required", {"type": "json_object"}),
    ({"type": "function", "function": {"name": "get_time"}},
     {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}}),
], ids=["required-json_schema", "required-json_object", "named-json_schema"])
def test_chat_forced_call_with_response_format_is_accepted(
    client: openai.OpenAI, tool_choice: Any, response_format: Any
) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": TOOL_QUESTION}], tools=CHAT_TOOLS,
        tool_choice=tool_choice, response_format=response_format, max_tokens=300, seed=0,
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls or []
    assert calls and choice.message.content is None
    for call in calls:
        assert call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    if isinstance(tool_choice, dict):
        assert {call.function.name for call in calls} == {"get_time"}


# -- logprobs ---------------------------------------------------------------------------------------------------
def test_include_logprobs_gives_each_text_tokens_logprob(client: openai.OpenAI) -> None:
    """`include: ["message.output_text.logprobs"]` with `top_logprobs`: one entry per token of the text, whose
    bytes spell it, each with at most that many alternatives, none likelier than greedy's own pick."""
    resp = create(client, include=["message.output_text.logprobs"], top_logprobs=3, temperature=0,
                  text={"format": PERSON_FORMAT}, max_output_tokens=60)
    part = the_message(resp).content[0]
    assert part.logprobs, part
    assert b"".join(bytes(entry.bytes) for entry in part.logprobs).decode() == part.text
    for entry in part.logprobs:
        assert entry.logprob <= 0 and len(entry.top_logprobs) <= 3
        assert all(alt.logprob <= entry.logprob + 1e-4 for alt in entry.top_logprobs)


def test_streamed_logprobs_match_the_deltas(client: openai.OpenAI) -> None:
    with client.responses.stream(model=MODEL, input=PROMPT, include=["message.output_text.logprobs"],
                                 max_output_tokens=40, extra_body={"seed": 0}) as stream:
        deltas = [event for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    streamed = [entry for event in deltas for entry in event.logprobs]
    text = final.output[0].content[0].text
    assert b"".join(bytes(entry.bytes) for entry in streamed).decode() == text
    assert [entry.token for entry in final.output[0].content[0].logprobs] == [entry.token for entry in streamed]


def test_without_include_there_are_no_logprobs(client: openai.OpenAI) -> None:
    assert the_message(create(client, max_output_tokens=10)).content[0].logprobs == []
