"""MCP tool results (seed 002): a tool's declared `outputSchema` is the definition of "this worked".

Server side, `finish_tool_result` turns a tool's raw structured result into the CallToolResult to send: the
value as `structuredContent` (plus the serialized text copy the spec asks for) only when it validates, else
`isError` with the failing path. Client side, `verified` is the success gate: it reads `isError` and
`structuredContent` only — never the text copy, which a model or a host may have rewritten — and hands back
the value only when it validates against the schema the tool declared. Both work on the MCP wire shape (dicts,
or the SDK's result objects), so this module needs no MCP SDK."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from corral.mediation.schemas import schema_error


@dataclass(frozen=True)
class ToolOutcome:
    ok: bool
    value: Any = None  # the validated structuredContent; None unless ok
    error: str | None = None
    path: str | None = None  # JSON pointer into structuredContent where it breaks the schema


def finish_tool_result(output_schema: dict[str, Any], structured: Any) -> dict[str, Any]:
    """The CallToolResult (MCP wire dict) for `structured`, checked against `output_schema` first."""
    error = schema_error(output_schema, structured)
    if error is not None:
        path, message = error
        text = f"Output failed schema at {path}: {message}"
        return {"isError": True, "content": [{"type": "text", "text": text}]}
    copy = json.dumps(structured, ensure_ascii=False)
    return {"isError": False, "structuredContent": structured, "content": [{"type": "text", "text": copy}]}


def verified(result: Any, output_schema: dict[str, Any]) -> ToolOutcome:
    """The success gate for a CallToolResult (dict or SDK object): ok only when it is not an error and its
    structuredContent validates against `output_schema`."""
    if _field(result, "isError", "is_error"):
        return ToolOutcome(False, error=_text(result) or "the tool reported an error")
    structured = _field(result, "structuredContent", "structured_content")
    if structured is None:
        return ToolOutcome(False, error="no structuredContent: the text copy is not evidence of success")
    error = schema_error(output_schema, structured)
    if error is not None:
        return ToolOutcome(False, error=error[1], path=error[0])
    return ToolOutcome(True, structured)


def _field(result: Any, wire: str, attribute: str) -> Any:
    if isinstance(result, dict):
        return result.get(wire)
    return getattr(result, attribute, None)


def _text(result: Any) -> str:
    content = _field(result, "content", "content") or []
    parts = [c.get("text") if isinstance(c, dict) else getattr(c, "text", None) for c in content]
    return " ".join(p for p in parts if isinstance(p, str))
