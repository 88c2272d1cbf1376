"""Chat rendering with tools (corral's default rendering and a template's own `tools`), the tool-call
format detection, and the answer → message / stream-delta pieces."""

from __future__ import annotations

import json
from typing import Any

import pytest
from transformers import AutoTokenizer

from corral.grammars.contract import validate_output
from corral.grammars.request import ConstraintRequest
from corral.grammars.tools import tool_calls_spec
from corral.server.openai.chat_render import MessageError, prompt_ids
from corral.server.openai.protocol import ChatMessage
from corral.server.openai.tools import ToolCallStream, chat_message, detect_format, parse_tools

PARAMS: dict[str, Any] = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
TOOLS = [{"type": "function", "function": {"name": "search", "description": "Look up", "parameters": PARAMS}}]
HISTORY = [
    ChatMessage(role="user", content="find cats"),
    ChatMessage(role="assistant", content=None, tool_calls=[
        {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": '{"q":"cats"}'}}]),
    ChatMessage(role="tool", tool_call_id="call_1", content="3 cats"),
]
# A Hermes-style template that renders `tools` and `tool_calls` itself.
NATIVE_TEMPLATE = (
    "{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} {{ c.function.arguments | tojson }}</tool_call>"
    "{% endfor %}</{{ m.role }}>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def default_tokenizer() -> Any:
    from corral.server.models import ensure_default_model

    return AutoTokenizer.from_pretrained(ensure_default_model())


def test_default_rendering_describes_tools_and_writes_calls_in_the_format(default_tokenizer: Any) -> None:
    tools = parse_tools(TOOLS, "auto", True)
    text = default_tokenizer.decode(prompt_ids(default_tokenizer, HISTORY, tools, "llama3_json"))
    system = text.index("<|start_header_id|>system")
    assert system < text.index("find cats")
    assert '"name":"search"' in text and "Look up" in text  # the tool listing
    assert '{"name": "search", "parameters": {"q": "cats"}}' in text  # the call, as the model writes it
    assert "<|start_header_id|>tool<|end_header_id|>\n\n3 cats" in text
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_without_tools_the_prompt_is_the_plain_template(default_tokenizer: Any) -> None:
    messages = [ChatMessage(role="user", content="hi")]
    expected = default_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                                     tokenize=False)
    ids = prompt_ids(default_tokenizer, messages, None, "llama3_json")
    assert default_tokenizer.decode(ids) == expected


def test_a_template_with_tools_gets_them_natively(default_tokenizer: Any) -> None:
    tokenizer = AutoTokenizer.from_pretrained(default_tokenizer.name_or_path)
    tokenizer.chat_template = NATIVE_TEMPLATE
    assert detect_format("auto", tokenizer) == "hermes"
    text = tokenizer.decode(prompt_ids(tokenizer, HISTORY, parse_tools(TOOLS, None, True), "hermes"),
                            skip_special_tokens=True)
    assert text.startswith('<tools>[{"type": "function"')
    assert '<tool_call>search {"q": "cats"}</tool_call>' in text  # arguments as an object, for the template


def test_a_template_gets_each_tool_in_openais_key_order(default_tokenizer: Any) -> None:
    """`tojson` writes keys as given, so the tools reach the template as OpenAI spells them (name, description,
    parameters): the prompt llama-server and vLLM render from the same request. With `parameters` first, Qwen2.5
    Coder 1.5B's greedy answer to a weather question under `auto` changed from a ```json call to `{{...}}}`."""
    tokenizer = AutoTokenizer.from_pretrained(default_tokenizer.name_or_path)
    tokenizer.chat_template = NATIVE_TEMPLATE
    messages = [ChatMessage(role="user", content="find cats")]
    text = tokenizer.decode(prompt_ids(tokenizer, messages, parse_tools(TOOLS, None, True), "hermes"),
                            skip_special_tokens=True)
    assert text.startswith(f"<tools>{json.dumps(TOOLS)}</tools>")

def test_format_detection(default_tokenizer: Any) -> None:
    assert detect_format("auto", default_tokenizer) == "llama3_json"
    assert detect_format("mistral", default_tokenizer) == "mistral"


def test_a_tool_message_needs_its_call_id(default_tokenizer: Any) -> None:
    with pytest.raises(MessageError) as caught:
        prompt_ids(default_tokenizer, [ChatMessage(role="tool", content="x")], None, "llama3_json")
    assert caught.value.param == "messages[0].tool_call_id"


def test_message_from_a_finished_answer() -> None:
    spec = tool_calls_spec([("search", PARAMS)], mode="auto")
    text = '{"name": "search", "parameters": {"q": "a"}}; {"name": "search", "parameters": {"q": "b"}}'
    message = chat_message(text, validate_output(spec, text))
    assert message["content"] is None
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == ['{"q": "a"}', '{"q": "b"}']
    assert len({c["id"] for c in message["tool_calls"]}) == 2
    assert chat_message("hello", validate_output(spec, "hello")) == {"role": "assistant", "content": "hello"}
    broken = '{"name": "search", "parameters": {}}'  # q is required: never returned as a call
    assert chat_message(broken, validate_output(spec, broken)) == {"role": "assistant", "content": broken}


def test_stream_deltas_rebuild_the_calls() -> None:
    spec = tool_calls_spec([("search", PARAMS)], format="hermes")
    text = '<tool_call>\n{"name": "search", "arguments": {"q": "a b"}}\n</tool_call>'
    stream = ToolCallStream.of(ConstraintRequest(spec))
    assert stream is not None
    deltas = [d for i in range(0, len(text), 3) for d in stream.feed(text[i:i + 3])] + stream.feed("", final=True)
    calls = [d["tool_calls"][0] for d in deltas]
    assert calls[0]["function"] == {"name": "search", "arguments": ""} and calls[0]["id"].startswith("call_")
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"q": "a b"}
    assert ToolCallStream.of(ConstraintRequest(None)) is None
