"""Chat messages (with tools, assistant tool calls and tool results) as the model's prompt.

A chat template that uses `tools` (Llama 3.1, Qwen, Hermes, Mistral, ...) gets them as it expects:
`apply_chat_template(messages, tools=...)`, assistant `tool_calls` with their arguments as objects, and
`role: "tool"` messages with their `tool_call_id`. A template without tool support (the embedded default
model's) gets corral's default rendering:

- the tools as a JSON list in a system message (prepended to the first system message if there is one),
  after one paragraph saying how to call them in the model's tool-call format;
- an assistant message's `tool_calls` as that format's text, after its content if any;
- `role: "tool"` messages as they are when the template takes the role, else as a user message that
  says which call the result answers.
"""

from __future__ import annotations

import json
from typing import Any

from corral.grammars.tools import FORMATS, ToolFormat
from corral.server.openai.protocol import ChatMessage
from corral.server.openai.tools import ToolRequest


class MessageError(ValueError):
    """A message the prompt cannot be built from; `param` names it (the server answers 400)."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.param = param


def prompt_ids(tokenizer: Any, messages: list[ChatMessage], tools: ToolRequest | None, fmt_name: str) -> list[int]:
    """The prompt's token ids, ending with the assistant's generation prompt."""
    native = template_uses_tools(tokenizer)
    rendered, template_tools = render_messages(messages, tools, fmt_name, native=native)
    extra: dict[str, Any] = {"tools": template_tools} if template_tools is not None else {}
    try:
        ids = _apply(tokenizer, rendered, extra)
    except Exception as exc:  # a template may reject a message order or the `tool` role; that is the input
        if not any(m["role"] == "tool" for m in rendered):
            raise MessageError(f"messages could not be rendered by the chat template: {exc}", param="messages") from exc
        try:
            ids = _apply(tokenizer, tool_results_as_user(rendered), extra)
        except Exception as again:
            raise MessageError(
                f"messages could not be rendered by the chat template: {again}", param="messages"
            ) from again
    return ids


def _apply(tokenizer: Any, messages: list[dict[str, Any]], extra: dict[str, Any]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **extra)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def template_uses_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    text = template if isinstance(template, str) else json.dumps(template or "")
    return "tools" in text


def tool_instructions(tools: ToolRequest, fmt: ToolFormat) -> str:
    example = fmt.render([("function_name", '{"argument": "value"}')])
    several = (
        f" To call several functions at once, join the calls as in {fmt.render([('a', '{}'), ('b', '{}')])}."
        if tools.parallel
        else " Call at most one function per answer."
    )
    # Compact: large parameter schemas cost prompt tokens (JSONSchemaBench: 15 of 203 past 4,096 even so).
    listing = json.dumps([f.openai() for f in tools.functions], ensure_ascii=False, separators=(",", ":"))
    return (
        "You can call the functions listed below. To call one, answer with only the call, written as "
        f"{example} with the function's name and its arguments as a JSON object that follows the function's "
        f"parameters schema.{several} When a function's result comes back, use it to answer. If no "
        f"function helps, answer in plain text.\n\nFunctions:\n{listing}"
    )


def render_messages(
    messages: list[ChatMessage], tools: ToolRequest | None, fmt_name: str, *, native: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages for the template, tools for the template or None)."""
    fmt = FORMATS[fmt_name]
    rendered = [_message(m, index, fmt, native=native) for index, m in enumerate(messages)]
    if tools is None:
        return rendered, None
    if native:
        return rendered, [f.openai() for f in tools.functions]
    instructions = tool_instructions(tools, fmt)
    if rendered and rendered[0]["role"] == "system":
        rendered[0] = {**rendered[0], "content": f"{instructions}\n\n{rendered[0]['content']}"}
    else:
        rendered.insert(0, {"role": "system", "content": instructions})
    return rendered, None


def _message(message: ChatMessage, index: int, fmt: ToolFormat, *, native: bool) -> dict[str, Any]:
    role = "system" if message.role == "developer" else message.role
    out: dict[str, Any] = {"role": role, "content": message.text()}
    if message.role == "tool":
        if not isinstance(message.tool_call_id, str) or not message.tool_call_id:
            raise MessageError(
                f"messages[{index}] has role 'tool' and needs the tool_call_id it answers",
                param=f"messages[{index}].tool_call_id",
            )
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        if message.role != "assistant":
            raise MessageError(
                f"messages[{index}]: only assistant messages carry tool_calls", param=f"messages[{index}].tool_calls"
            )
        calls = [_call(call, f"messages[{index}].tool_calls[{j}]") for j, call in enumerate(message.tool_calls)]
        if native:
            out["tool_calls"] = [
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.loads(args)}}
                for call_id, name, args in calls
            ]
        else:
            text = fmt.render([(name, args) for _, name, args in calls])
            out["content"] = f"{out['content']}{text}"
    return out


def _call(call: Any, param: str) -> tuple[str, str, str]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise MessageError(f"{param}.function.name is required", param=f"{param}.function.name")
    arguments = function.get("arguments", "{}")
    if not isinstance(arguments, str):
        raise MessageError(f"{param}.function.arguments must be a JSON string", param=f"{param}.function.arguments")
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError as exc:
        raise MessageError(
            f"{param}.function.arguments is not valid JSON: {exc.msg}", param=f"{param}.function.arguments"
        ) from exc
    compact = json.dumps(value, ensure_ascii=False)  # the spacing corral's grammars produce
    return str(call.get("id", "")), str(function["name"]), compact


def tool_results_as_user(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For a template that refuses the `tool` role: each result as a user message naming its call."""
    return [
        {"role": "user", "content": f"Result of tool call {m.get('tool_call_id', '')}: {m['content']}"}
        if m["role"] == "tool"
        else m
        for m in messages
    ]
