"""OpenAI tool calling: the request's `tools` / `tool_choice` / `parallel_tool_calls` checked and turned into a
tool-call constraint (corral/grammars/tools.py), and a finished or streaming answer turned into `message.tool_calls`.

- `tool_choice` `none`: no constraint from the tools (the tools are still described in the prompt, as OpenAI
  does); `auto`: text or calls; `required`: one or more calls; a named function: calls to that function only.
  Without `tools`, `tool_choice` defaults to `none`; with them, to `auto`.
- `parallel_tool_calls: false`: at most one call per answer.
- `strict` is accepted and changes nothing: every call corral returns is generated under, and validated
  against, its function's full `parameters` schema.
- With `auto`, `response_format` / `structured_outputs.json` (a JSON Schema or JSON object) constrains the text
  branch; beside a forced call (`required` or a named function) it is accepted and shapes nothing in this
  answer, which is a call. Any other constraint beside tools is a 400.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from corral.grammars.contract import has_tool_calls
from corral.grammars.limits import DEFAULT_LIMITS, InputLimits, check_count, check_schema_limits
from corral.grammars.request import ConstraintRequest
from corral.grammars.spec import GrammarKind
from corral.grammars.tools import DEFAULT_FORMAT, Mode, ScannedCall, ToolAnswer, ToolGrammar, scan, tool_calls_spec
from corral.grammars.validation import InvalidConstraint, OutputCheck, check_schema

TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
CHOICES = ("none", "auto", "required")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    parameters: dict[str, Any]

    def openai(self) -> dict[str, Any]:
        """As OpenAI's `tools[i]` (what chat templates with native tool support expect), in OpenAI's key order:
        a template writes the tools with `tojson`, keys as given, so this order is the prompt llama-server and vLLM
        render from the same request (and the one models are trained on). With `parameters` before `description`,
        Qwen2.5-Coder 1.5B's greedy answer to a weather question under `auto` opened with `{{` instead of ```."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolRequest:
    functions: tuple[Function, ...]
    choice: str  # none | auto | required | a function name
    parallel: bool

    @property
    def calls_allowed(self) -> bool:
        return self.choice != "none"


def parse_tools(
    tools: Any, tool_choice: Any, parallel: bool, *, limits: InputLimits = DEFAULT_LIMITS
) -> ToolRequest | None:
    """Check the request's tool fields; InvalidConstraint (a 400 naming the field) when wrong."""
    if tools is None:
        if tool_choice not in (None, "none"):
            raise InvalidConstraint("tool_choice is only allowed when tools are given", param="tool_choice")
        return None
    if not isinstance(tools, list) or not tools:
        raise InvalidConstraint("tools must be a non-empty list of function tools", param="tools")
    check_count(len(tools), limits.max_tools, what="tools", flag="max-tools", param="tools")
    functions = [_function(tool, f"tools[{index}]", limits) for index, tool in enumerate(tools)]
    names = [f.name for f in functions]
    for index, name in enumerate(names):
        if name in names[:index]:
            raise InvalidConstraint(f"two tools are named {name!r}", param=f"tools[{index}].function.name")
    return ToolRequest(tuple(functions), _choice(tool_choice, names), parallel)


def _function(tool: Any, param: str, limits: InputLimits) -> Function:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise InvalidConstraint(f"{param}.type must be 'function'", param=f"{param}.type")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise InvalidConstraint(f"{param}.function must be an object", param=f"{param}.function")
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise InvalidConstraint(
            f"{param}.function.name must be 1-64 characters of a-z, A-Z, 0-9, _ and -, got {name!r}",
            param=f"{param}.function.name",
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidConstraint(f"{param}.function.description must be a string", param=f"{param}.function.description")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidConstraint(f"{param}.function.strict must be a boolean", param=f"{param}.function.strict")
    parameters = function.get("parameters", EMPTY_PARAMETERS)
    where = f"{param}.function.parameters"
    if not isinstance(parameters, dict):
        raise InvalidConstraint(f"{where} must be a JSON Schema object", param=where)
    check_schema_limits(parameters, limits, param=where)
    check_schema(parameters, param=where)
    return Function(name, description, parameters)


def _choice(tool_choice: Any, names: list[str]) -> str:
    if tool_choice is None:
        return "auto"
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise InvalidConstraint(
                f"tool_choice must be one of {', '.join(CHOICES)} or a named function, got {tool_choice!r}",
                param="tool_choice",
            )
        return tool_choice
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(function, dict):
        raise InvalidConstraint(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    name = function.get("name")
    if name not in names:
        raise InvalidConstraint(
            f"tool_choice names {name!r}, which is not among the tools ({', '.join(names)})",
            param="tool_choice.function.name",
        )
    return str(name)


def tool_constraint(tools: ToolRequest | None, constraint: ConstraintRequest, fmt: str) -> ConstraintRequest:
    """The request's constraint once its tools are taken into account."""
    if tools is None or not tools.calls_allowed:
        return constraint
    text_schema: dict[str, Any] | None = None
    if constraint.spec is not None:
        param = constraint.source or "response_format"
        if not constraint.spec.is_json:
            raise InvalidConstraint(
                f"beside tools, {param} may only be a JSON Schema or a JSON object (it shapes a text answer)",
                param=param,
            )
        # A forced call has no text for the format to shape: it applies in a later turn (agents send the
        # pair, then tool_choice auto once the tool answered), as OpenAI accepts it.
        if tools.choice == "auto":
            schema = constraint.spec.schema()
            text_schema = schema if isinstance(schema, dict) else {}
    if tools.choice in ("auto", "required"):
        functions = tools.functions
        mode: Mode = "auto" if tools.choice == "auto" else "required"
    else:
        functions = tuple(f for f in tools.functions if f.name == tools.choice)
        mode = "required"
    spec = tool_calls_spec(
        [(f.name, f.parameters) for f in functions],
        format=fmt,
        mode=mode,
        parallel=tools.parallel,
        text_schema=text_schema,
    )
    return ConstraintRequest(spec, constraint.backend, "tools")


def detect_format(setting: str, tokenizer: Any) -> str:
    """`--tool-call-format`, or the model family's own, read from its chat template and vocabulary:
    Hermes/Qwen templates write `<tool_call>`, Mistral's `[TOOL_CALLS]`; Llama 3.1's JSON otherwise (and for
    the embedded default model)."""
    if setting != "auto":
        return setting
    template = getattr(tokenizer, "chat_template", None)
    text = template if isinstance(template, str) else json.dumps(template or "")
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    if "<tool_call>" in text:
        return "hermes"
    if "[TOOL_CALLS]" in text or "[TOOL_CALLS]" in vocab:
        return "mistral"
    return DEFAULT_FORMAT


# -- responses -------------------------------------------------------------------------------------------------
def new_call_id() -> str:
    return "call_" + secrets.token_urlsafe(18).replace("-", "a").replace("_", "b")


def chat_message(text: str, check: OutputCheck | None) -> dict[str, Any]:
    """The assistant message of a finished answer: `tool_calls` (content null) when it called tools,
    else the text. An answer whose calls failed the contract is never returned as calls."""
    if has_tool_calls(check):
        assert check is not None and isinstance(check.value, ToolAnswer)
        calls = [
            {"id": new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in check.value.calls
        ]
        return {"role": "assistant", "content": None, "tool_calls": calls}
    if check is not None and check.valid and isinstance(check.value, ToolAnswer):
        return {"role": "assistant", "content": check.value.content}
    return {"role": "assistant", "content": text}


class ToolCallStream:
    """Turns the growing text of a tool-call answer into OpenAI's chunk deltas: a call's id, type and name
    first (with empty arguments), then its arguments in pieces, or plain `content` for a text answer."""

    def __init__(self, grammar: ToolGrammar) -> None:
        self._grammar = grammar
        self._text = ""
        self._sent_content = 0
        self._sent_args: list[int] = []  # characters of each call's arguments already sent

    @classmethod
    def of(cls, constraint: ConstraintRequest) -> ToolCallStream | None:
        spec = constraint.spec
        return cls(ToolGrammar.of(spec)) if spec is not None and spec.kind is GrammarKind.TOOL_CALLS else None

    def feed(self, delta: str, *, final: bool = False) -> list[dict[str, Any]]:
        self._text += delta
        found = scan(self._grammar, self._text, final=final)
        if found.content is not None:
            piece = found.content[self._sent_content :]
            self._sent_content = len(found.content)
            return [{"content": piece}] if piece else []
        return [delta for index, call in enumerate(found.calls) for delta in self._call_deltas(index, call)]

    def _call_deltas(self, index: int, call: ScannedCall) -> list[dict[str, Any]]:
        deltas = []
        if index == len(self._sent_args):
            self._sent_args.append(0)
            head = {"index": index, "id": new_call_id(), "type": "function"}
            deltas.append({"tool_calls": [{**head, "function": {"name": call.name, "arguments": ""}}]})
        piece = call.arguments[self._sent_args[index] :]
        if piece:
            self._sent_args[index] = len(call.arguments)
            deltas.append({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
        return deltas
