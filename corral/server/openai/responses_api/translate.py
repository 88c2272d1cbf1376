"""A Responses API request in chat's terms, so it takes the chat path whole: the same prompt rendering, tool
parsing, constraint compile, routing, guard and output check.

- `instructions` is a system message before the input; `input` is one user message (a string) or items:
  messages (text parts only), `function_call` items (an assistant's tool calls, merged into the assistant
  message before them) and `function_call_output` items (tool results).
- `tools` are function tools in the Responses shape (`name` at the top); hosted tools are a 400 naming them.
- `text.format` is chat's `response_format`; `max_output_tokens` is `max_completion_tokens`; `include`'s
  `message.output_text.logprobs` (or `top_logprobs`) is chat's `logprobs`.

A 400 that the chat path raises names a chat field; `ChatForm.rename` turns it back into the Responses field
the caller sent (`tools[0].function.name` -> `tools[0].name`, `messages[2]` -> `input[1]`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from corral.server.errors import ApiError, bad_request
from corral.server.openai.fields import part_text, refuse_unknown_keys
from corral.server.openai.protocol import ChatCompletionRequest
from corral.server.openai.responses_api.request import LOGPROBS_INCLUDE, ResponsesRequest

MESSAGE_ROLES = frozenset({"user", "system", "developer", "assistant"})
TEXT_PARTS = frozenset({"input_text", "output_text"})
# Keys an input item may carry besides its content; ids and statuses come back from an earlier response.
ITEM_KEYS = {
    "message": frozenset({"type", "role", "content", "id", "status", "phase"}),
    "function_call": frozenset({"type", "call_id", "name", "arguments", "id", "status"}),
    "function_call_output": frozenset({"type", "call_id", "output", "id", "status"}),
}
FUNCTION_TOOL_KEYS = frozenset({"type", "name", "description", "parameters", "strict"})
FORMAT_KEYS = {
    "text": frozenset({"type"}),
    "json_object": frozenset({"type"}),
    "json_schema": frozenset({"type", "name", "schema", "strict", "description"}),
}


@dataclass(frozen=True)
class ChatForm:
    request: ChatCompletionRequest
    message_params: tuple[str, ...]  # for each chat message, the Responses field it came from

    def rename(self, error: ApiError) -> ApiError:
        """The same error, naming the Responses field instead of the chat one."""
        param = self._rename(error.param) if error.param else error.param
        return ApiError(error.status, self._rename(error.message), type_=error.type, param=param, code=error.code)

    def _rename(self, text: str) -> str:
        text = re.sub(r"tools\[(\d+)\]\.function\.", r"tools[\1].", text)
        text = text.replace("tool_choice.function.name", "tool_choice.name")
        text = re.sub(r"\bresponse_format(\.json_schema)?\b", "text.format", text)
        text = re.sub(r"\bmax_completion_tokens\b", "max_output_tokens", text)
        text = re.sub(r"messages\[(\d+)\]", lambda m: self._message_param(int(m.group(1))), text)
        return re.sub(r"\bmessages\b", "input", text)

    def _message_param(self, index: int) -> str:
        return self.message_params[index] if index < len(self.message_params) else "input"


def chat_form(req: ResponsesRequest) -> ChatForm:
    messages, params = _messages(req)
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "tools": _tools(req.tools),
        "tool_choice": _tool_choice(req.tool_choice),
        "response_format": _response_format(req.text_format()),
        "structured_outputs": req.structured_outputs,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "seed": req.seed,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "repetition_penalty": req.repetition_penalty,
        "max_revisions": req.max_revisions,
        "close_answers": req.close_answers,
        "json_leading_whitespace": req.json_leading_whitespace,
        "json_whitespace": req.json_whitespace,
        "drafts": req.drafts,
        "logprobs": _logprobs(req),
        "top_logprobs": req.top_logprobs if req.wants_logprobs() else None,
    }
    if req.tools:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    try:
        chat = ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as exc:  # every field was checked above in Responses terms; this is a safety net
        raise bad_request(f"the request could not be read: {exc.errors()[0]['msg']}", param="input") from exc
    return ChatForm(chat, tuple(params))


# -- input ------------------------------------------------------------------------------------------------------
def _messages(req: ResponsesRequest) -> tuple[list[dict[str, Any]], list[str]]:
    messages: list[dict[str, Any]] = []
    params: list[str] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
        params.append("instructions")
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
        params.append("input")
        return messages, params
    if not req.input:
        raise bad_request("input must be a string or a non-empty list of items", param="input")
    for index, item in enumerate(req.input):
        param = f"input[{index}]"
        kind = _item_kind(item, param)
        if kind == "function_call":
            call = _function_call(item, param)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the same turn: one message, several calls
                last.setdefault("tool_calls", []).append(call)
                continue
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(
                {"role": "tool", "tool_call_id": _string(item, "call_id", param), "content": _output(item, param)}
            )
        else:
            role = item.get("role")
            if role not in MESSAGE_ROLES:
                roles = ", ".join(sorted(MESSAGE_ROLES))
                raise bad_request(f"{param}.role must be one of {roles}, got {role!r}", param=f"{param}.role")
            messages.append({"role": role, "content": _text(item.get("content"), f"{param}.content")})
        params.append(param)
    return messages, params


def _item_kind(item: Any, param: str) -> str:
    if not isinstance(item, dict):
        raise bad_request(f"{param} must be an object (a message or a function call item)", param=param)
    kind = item.get("type", "message")
    allowed = ITEM_KEYS.get(kind)
    if allowed is None:
        raise bad_request(
            f"{param}.type: corral does not implement {kind!r} input items (it takes message, function_call "
            "and function_call_output)",
            param=f"{param}.type",
            code="unsupported_content",
        )
    refuse_unknown_keys(item, allowed, param, f"field of a {kind} item")
    return str(kind)


def _text(content: Any, param: str) -> str:
    """A message's content: a string, or text parts (`input_text`, `output_text`) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{param} must be a string or a list of text parts", param=param)
    return "".join(part_text(part, f"{param}[{index}]", TEXT_PARTS) for index, part in enumerate(content))


def _string(item: dict[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{param}.{key} must be a non-empty string", param=f"{param}.{key}")
    return value


def _function_call(item: dict[str, Any], param: str) -> dict[str, Any]:
    arguments = item.get("arguments", "{}")
    if not isinstance(arguments, str):
        raise bad_request(f"{param}.arguments must be a JSON string", param=f"{param}.arguments")
    function = {"name": _string(item, "name", param), "arguments": arguments}
    return {"id": _string(item, "call_id", param), "type": "function", "function": function}


def _output(item: dict[str, Any], param: str) -> str:
    output = item.get("output")
    if output is None:
        raise bad_request(f"{param}.output is required: the function's result", param=f"{param}.output")
    return _text(output, f"{param}.output")


def _logprobs(req: ResponsesRequest) -> bool:
    for index, value in enumerate(req.include or ()):
        if value != LOGPROBS_INCLUDE:
            raise bad_request(
                f"include[{index}]: corral does not implement {value!r} (it includes {LOGPROBS_INCLUDE!r} only)",
                param=f"include[{index}]",
                code="unsupported_parameter",
            )
    return req.wants_logprobs()


# -- tools and format -------------------------------------------------------------------------------------------
def _tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    if not tools:  # `[]` is how the Responses API says "no tools" (openai-agents sends it); chat wants none
        return None
    converted = []
    for index, tool in enumerate(tools):
        param = f"tools[{index}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise bad_request(
                f"{param}.type: corral serves function tools only; {kind!r} is a hosted tool it does not implement",
                param=f"{param}.type",
                code="unsupported_parameter",
            )
        refuse_unknown_keys(tool, FUNCTION_TOOL_KEYS, param, "field of a function tool")
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
        converted.append({"type": "function", "function": function})
    return converted


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function":
        raise bad_request(
            f"tool_choice.type: corral does not implement {choice.get('type')!r} (it takes none, auto, required "
            'or {"type": "function", "name": ...})',
            param="tool_choice.type",
            code="unsupported_parameter",
        )
    return {"type": "function", "function": {"name": choice.get("name")}}


def _response_format(fmt: dict[str, Any] | None) -> dict[str, Any] | None:
    if fmt is None:
        return None
    kind = fmt.get("type")
    allowed = FORMAT_KEYS.get(kind) if isinstance(kind, str) else None
    if allowed is None:
        raise bad_request(
            f"text.format.type must be text, json_object or json_schema, got {kind!r}", param="text.format.type"
        )
    refuse_unknown_keys(fmt, allowed, "text.format", f"field of a {kind} format")
    if kind != "json_schema":
        return {"type": kind}
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
