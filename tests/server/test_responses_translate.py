"""The Responses API read as chat (corral/server/openai/responses_api/translate.py) and its stream's items
(stream.py), without a server: what a caller sends becomes the chat request the chat path already serves, a
400 names the field the caller sent, and streamed items close with the ids they were announced with."""

from __future__ import annotations

from typing import Any

import pytest

from corral.server.errors import ApiError
from corral.server.openai.responses_api.output import call_item, message_item
from corral.server.openai.responses_api.request import ResponsesRequest
from corral.server.openai.responses_api.stream import StreamedItems
from corral.server.openai.responses_api.translate import chat_form

TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}, "strict": True}


def _messages(**body: Any) -> list[dict[str, Any]]:
    chat = chat_form(ResponsesRequest.model_validate(body)).request
    return [m.model_dump(exclude_none=True) for m in chat.messages]


def test_instructions_and_a_string_input_are_a_system_and_a_user_message() -> None:
    assert _messages(instructions="Be brief.", input="hi") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]


def test_a_turn_with_text_and_calls_is_one_assistant_message_and_results_are_tool_messages() -> None:
    items = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Oslo"}, {"type": "input_text",
                                                                                               "text": " and Rome?"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
    ]
    messages = _messages(input=items, tools=[TOOL])
    assert messages[0] == {"role": "user", "content": "Oslo and Rome?"}
    assert messages[1]["content"] == "Checking."
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"]
    assert messages[2:] == [
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
    ]


@pytest.mark.parametrize(("fields", "logprobs", "top"), [
    ({}, False, None),
    ({"include": []}, False, None),
    ({"include": ["message.output_text.logprobs"]}, True, None),
    ({"include": ["message.output_text.logprobs"], "top_logprobs": 4}, True, 4),
    ({"top_logprobs": 2}, True, 2),
])
def test_logprobs_are_asked_by_include_or_top_logprobs(fields: dict[str, Any], logprobs: bool, top: int | None) -> None:
    chat = chat_form(ResponsesRequest.model_validate({"input": "x", **fields})).request
    assert (chat.logprobs, chat.top_logprobs) == (logprobs, top)


def test_an_empty_tools_list_means_no_tools() -> None:
    chat = chat_form(ResponsesRequest.model_validate({"input": "x", "tools": [], "parallel_tool_calls": True})).request
    assert chat.tools is None and chat.tool_choice is None


def test_tools_format_and_budget_become_chat_fields() -> None:
    body = {
        "input": "x",
        "tools": [TOOL],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "text": {"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}, "strict": True}},
        "max_output_tokens": 17,
        "parallel_tool_calls": False,
    }
    chat = chat_form(ResponsesRequest.model_validate(body)).request
    assert chat.tools == [{"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.response_format == {
        "type": "json_schema", "json_schema": {"name": "out", "schema": {"type": "object"}, "strict": True}
    }
    assert (chat.max_completion_tokens, chat.parallel_tool_calls) == (17, False)


@pytest.mark.parametrize(("body", "param"), [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": []}, "input"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{**TOOL, "defer_loading": True}]}, "tools[0].defer_loading"),
    ({"input": "x", "tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice.type"),
    ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ({"input": "x", "text": {"format": {"type": "json_object", "schema": {}}}}, "text.format.schema"),
    ({"input": "x", "include": ["message.output_text.logprobs", "file_search_call.results"]}, "include[1]"),
])
def test_what_the_chat_path_cannot_read_is_a_400_naming_the_responses_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as caught:
        chat_form(ResponsesRequest.model_validate(body))
    assert (caught.value.status, caught.value.param) == (400, param)


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "store": True}, "store"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "text": {"verbosity": "low"}}, "text.verbosity"),
    ({"input": "x", "max_tokens": 5}, "max_tokens"),  # chat's name, not this API's
])
def test_state_corral_does_not_keep_is_refused_by_the_registry(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as caught:
        ResponsesRequest.model_validate(body)
    assert caught.value.param == param


def test_neutral_values_of_refused_fields_are_accepted() -> None:
    req = ResponsesRequest.model_validate(
        {"input": "x", "store": False, "include": [], "background": False, "truncation": "disabled", "user": "u"}
    )
    assert req.input == "x"


def test_a_chat_error_is_renamed_to_the_field_the_caller_sent() -> None:
    body = {"instructions": "s", "input": [{"role": "user", "content": "u"}]}
    form = chat_form(ResponsesRequest.model_validate(body))
    cases = {
        "tools[1].function.parameters": "tools[1].parameters",
        "tool_choice.function.name": "tool_choice.name",
        "response_format.json_schema.schema": "text.format.schema",
        "max_completion_tokens": "max_output_tokens",
        "messages[0]": "instructions",
        "messages[1].content": "input[0].content",
    }
    for chat_param, responses_param in cases.items():
        renamed = form.rename(ApiError(400, f"{chat_param} is wrong", param=chat_param, code="x"))
        assert (renamed.param, renamed.message, renamed.code) == (responses_param, f"{responses_param} is wrong", "x")


def _fold(events: list[tuple[str, dict[str, Any]]]) -> dict[int, dict[str, Any]]:
    """What a client rebuilds from the events: each item as announced, grown by its deltas."""
    items: dict[int, dict[str, Any]] = {}
    for kind, fields in events:
        if kind == "response.output_item.added":
            items[fields["output_index"]] = fields["item"]
        elif kind == "response.content_part.added":
            items[fields["output_index"]]["content"].append(fields["part"])
        elif kind == "response.output_text.delta":
            items[fields["output_index"]]["content"][0]["text"] += fields["delta"]
        elif kind == "response.function_call_arguments.delta":
            items[fields["output_index"]]["arguments"] += fields["delta"]
    return items


def test_streamed_calls_close_with_the_ids_they_were_announced_with() -> None:
    items = StreamedItems()
    events = []
    for piece in (
        {"tool_calls": [{"index": 0, "id": "call_a", "type": "function", "function": {"name": "f", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"x": '}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]},
    ):
        events += items.on_piece(piece)
    streamed = _fold(events)
    closing, output = items.close([call_item("f", '{"x": 1}', "completed", call_id="call_other")], "completed")
    assert streamed[0]["arguments"] == output[0]["arguments"] == '{"x": 1}'
    assert (output[0]["id"], output[0]["call_id"]) == (streamed[0]["id"], "call_a")
    assert [kind for kind, _ in closing] == ["response.function_call_arguments.done", "response.output_item.done"]


def test_text_that_never_streamed_is_announced_before_it_closes() -> None:
    items = StreamedItems()
    closing, output = items.close([message_item("", "completed")], "completed")
    assert [kind for kind, _ in closing] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
    ]
    assert closing[0][1]["item"]["status"] == "in_progress" and output[0]["status"] == "completed"


def test_calls_that_failed_their_contract_stay_the_streamed_items_marked_incomplete() -> None:
    items = StreamedItems()
    head = {"index": 0, "id": "call_a", "type": "function", "function": {"name": "f", "arguments": '{"x": '}}
    items.on_piece({"tool_calls": [head]})
    # The final answer reads as text (its calls broke the schema): the items the client holds stay calls.
    closing, output = items.close([message_item('<call>{"x": ', "incomplete")], "incomplete")
    assert [item["type"] for item in output] == ["function_call"]
    assert output[0]["status"] == "incomplete" and output[0]["arguments"] == '{"x": '
    assert closing[-1] == ("response.output_item.done", {"output_index": 0, "item": output[0]})
