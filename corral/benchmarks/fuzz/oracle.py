"""What a hostile or generated request may get back: no 5xx, every 4xx in OpenAI's error shape, and no
fail-open (an answer that ends `stop` or `tool_calls` and breaks the constraint its request declared).

Shared by the hostile corpus test, the fuzz benchmark and the soak benchmark, so all three judge alike."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from corral.grammars.formats import FORMAT_CHECKER

ERROR_KEYS = frozenset({"message", "type", "param", "code"})


@dataclass(frozen=True)
class Constraint:
    """The shape a request asked for, as far as a client can check it (`grammar` answers are not checked)."""

    kind: str  # json_schema | choice | regex | grammar | tools
    value: Any = None


def error_shape_problem(status: int, body: Any) -> str | None:
    """Why a 4xx/5xx body is not OpenAI's `{"error": {message, type, param, code}}`, or None."""
    if not isinstance(body, dict) or set(body) != {"error"}:
        return f"{status} body is not {{'error': ...}}: {_short(body)}"
    error = body["error"]
    if not isinstance(error, dict) or set(error) != ERROR_KEYS:
        return f"{status} error object keys are not {sorted(ERROR_KEYS)}: {_short(error)}"
    if not isinstance(error["message"], str) or not error["message"]:
        return f"{status} error.message is empty"
    if not isinstance(error["type"], str):
        return f"{status} error.type is not a string"
    if error["param"] is not None and not isinstance(error["param"], str):
        return f"{status} error.param is neither null nor a string"
    return None


def request_constraint(body: Any) -> Constraint | None:
    """The one constraint a chat/completions request body declares (None: unconstrained or unreadable)."""
    if not isinstance(body, Mapping):
        return None
    tools = body.get("tools")
    if isinstance(tools, list) and tools and body.get("tool_choice") != "none":
        return Constraint("tools", _tool_schemas(tools))
    fmt = body.get("response_format")
    if isinstance(fmt, Mapping):
        if fmt.get("type") == "json_object":
            return Constraint("json_schema", {"type": "object"})
        inner = fmt.get("json_schema")
        if fmt.get("type") == "json_schema" and isinstance(inner, Mapping):
            return Constraint("json_schema", inner.get("schema", {}))
    outputs = body.get("structured_outputs")
    structured = dict(outputs) if isinstance(outputs, Mapping) else {}
    for legacy, key in (("guided_json", "json"), ("guided_json_object", "json_object"), ("guided_choice", "choice"),
                        ("guided_regex", "regex"), ("guided_grammar", "grammar")):
        if body.get(legacy) is not None:
            structured.setdefault(key, body[legacy])
    if structured.get("json") is not None:
        schema = structured["json"]
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError:
                return None
        return Constraint("json_schema", schema)
    if structured.get("json_object"):
        return Constraint("json_schema", {"type": "object"})
    if isinstance(structured.get("choice"), list):
        return Constraint("choice", structured["choice"])
    if isinstance(structured.get("regex"), str):
        return Constraint("regex", structured["regex"])
    if structured.get("grammar") is not None:
        return Constraint("grammar", structured["grammar"])
    return None


def fail_open_problems(request: Any, response: Any) -> list[str]:
    """Every choice of a 200 answer that ended `stop`/`tool_calls` yet breaks the request's constraint."""
    constraint = request_constraint(request)
    if constraint is None or not isinstance(response, Mapping):
        return []
    problems: list[str] = []
    for i, choice in enumerate(response.get("choices") or []):
        if not isinstance(choice, Mapping):
            continue
        problem = _choice_problem(constraint, choice)
        if problem:
            problems.append(f"choices[{i}] ({constraint.kind}, finish {choice.get('finish_reason')}): {problem}")
    return problems


def _choice_problem(constraint: Constraint, choice: Mapping[str, Any]) -> str | None:
    finish = choice.get("finish_reason")
    message = choice.get("message") if isinstance(choice.get("message"), Mapping) else None
    text = message.get("content") if message is not None else choice.get("text")
    if constraint.kind == "tools":
        if finish == "tool_calls" and message is not None:
            return _tool_calls_problem(constraint.value, message.get("tool_calls"))
        return None  # a text answer under tool_choice auto is unconstrained
    if finish != "stop":
        return None
    if not isinstance(text, str):
        return f"content is {_short(text)}, not text"
    if constraint.kind == "json_schema":
        return _schema_problem(constraint.value, text)
    if constraint.kind == "choice":
        return None if text in constraint.value else f"{_short(text)} is not one of the choices"
    if constraint.kind == "regex":
        try:
            pattern = re.compile(constraint.value)
        except (re.error, RecursionError, OverflowError):
            return None  # a dialect Python cannot read: not checkable here
        return None if pattern.fullmatch(text) else f"{_short(text)} does not match the regex"
    return None  # grammar answers: no client-side parser for every syntax


def _schema_problem(schema: Any, text: str) -> str | None:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return f"{_short(text)} is not JSON"
    try:
        errors = Draft202012Validator(schema, format_checker=FORMAT_CHECKER).iter_errors(value)
        first = next(errors, None)
    except (SchemaError, RecursionError, ValueError, TypeError, LookupError):
        return None  # the schema itself defeats the checker; the server's own answer is the evidence
    return None if first is None else f"{_short(text)} breaks the schema: {first.message[:200]}"


def _tool_schemas(tools: list[Any]) -> dict[str, Any]:
    schemas: dict[str, Any] = {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            schemas[function["name"]] = function.get("parameters") or {"type": "object"}
    return schemas


def _tool_calls_problem(schemas: Mapping[str, Any], calls: Any) -> str | None:
    if not isinstance(calls, list) or not calls:
        return "finish tool_calls without tool_calls"
    for call in _functions(calls):
        name, arguments = call.get("name"), call.get("arguments")
        if not isinstance(name, str) or name not in schemas:
            return f"call to unknown function {_short(name)}"
        if not isinstance(arguments, str):
            return f"arguments of {name} are not a JSON string"
        problem = _schema_problem(schemas[name], arguments)
        if problem:
            return f"{name}: {problem}"
    return None


def _functions(calls: list[Any]) -> Iterator[Mapping[str, Any]]:
    for call in calls:
        function = call.get("function") if isinstance(call, Mapping) else None
        yield function if isinstance(function, Mapping) else {}


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
