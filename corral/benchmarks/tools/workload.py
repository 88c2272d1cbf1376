"""What the tool-call benchmark sends: each schema as the `parameters` of one function, a call required."""

from __future__ import annotations

import re
from typing import Any

from corral.benchmarks.jsonschemabench.dataset import SchemaCase

TOOL_CHOICES = ("required", "auto", "named")
_NAME_BAD = re.compile(r"[^a-zA-Z0-9_-]")


def function_name(case: SchemaCase) -> str:
    """OpenAI's function names are ^[a-zA-Z0-9_-]{1,64}$: the file name's stem, other characters as '_'."""
    stem = case.name.rsplit(".", 1)[0]
    return (_NAME_BAD.sub("_", stem) or "call")[:64]


def tool(case: SchemaCase) -> dict[str, Any]:
    schema = case.schema if isinstance(case.schema, dict) else {}
    description = schema.get("description") or schema.get("title") or f"JSONSchemaBench {case.case_id}"
    return {"type": "function", "function": {
        "name": function_name(case), "description": str(description)[:300], "parameters": case.schema}}


def tool_choice_value(choice: str, case: SchemaCase) -> str | dict[str, Any]:
    if choice == "named":
        return {"type": "function", "function": {"name": function_name(case)}}
    if choice in TOOL_CHOICES:
        return choice
    raise ValueError(f"--tool-choice must be one of {', '.join(TOOL_CHOICES)}, got {choice!r}")


def tools_request(case: SchemaCase, *, max_tokens: int, tool_choice: str = "required", model: str | None = None,
                  seed: int = 0) -> dict[str, Any]:
    """One user turn asking for the call, the one tool, greedy. The schema reaches the model only through
    the tool definition, as in real use."""
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": f"Call the function {function_name(case)} with valid arguments."}],
        "tools": [tool(case)], "tool_choice": tool_choice_value(tool_choice, case),
        "max_tokens": max_tokens, "temperature": 0.0, "seed": seed,
    }
    if model is not None:
        body["model"] = model
    return body
