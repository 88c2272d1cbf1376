"""MCP tool results through the real MCP Python SDK (in-process server and client): the tool server finishes
every result against its outputSchema, and the client's success gate reads only the validated value."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from corral.mediation.mcp_results import finish_tool_result, verified

mcp = pytest.importorskip("mcp")
types = pytest.importorskip("mcp_types")

DELETE_OUTPUT = {
    "type": "object",
    "properties": {"deleted": {"type": "boolean"}, "customer_id": {"type": "string"},
                   "deleted_at": {"type": "string", "format": "date-time"}},
    "required": ["deleted", "customer_id", "deleted_at"],
}
# What the upstream API answered, per customer id: a clean result, a 502 that yielded {}, a malformed field.
UPSTREAM: dict[str, Any] = {
    "c1": {"deleted": True, "customer_id": "c1", "deleted_at": "2026-11-23T12:00:00Z"},
    "c502": {},
    "c3": {"deleted": "yes", "customer_id": "c3", "deleted_at": "2026-11-23T12:00:00Z"},
    "c4": {"deleted": True, "customer_id": "c4", "deleted_at": "yesterday"},
}


def _server() -> Any:
    async def list_tools(ctx: Any, params: Any) -> Any:
        tool = types.Tool(name="delete_customer", input_schema={
            "type": "object", "properties": {"customer_id": {"type": "string"}}, "required": ["customer_id"]},
            output_schema=DELETE_OUTPUT)
        return types.ListToolsResult(tools=[tool])

    async def call_tool(ctx: Any, params: Any) -> Any:
        raw = UPSTREAM[params.arguments["customer_id"]]
        return types.CallToolResult.model_validate(finish_tool_result(DELETE_OUTPUT, raw))

    return mcp.server.Server("customers", on_list_tools=list_tools, on_call_tool=call_tool)


def _call_all() -> dict[str, Any]:
    results: dict[str, Any] = {}

    async def run() -> None:
        async with mcp.Client(_server()) as client:
            await client.list_tools()
            for customer in UPSTREAM:
                results[customer] = await client.call_tool("delete_customer", {"customer_id": customer})

    anyio.run(run)
    return results


def test_mismatch_becomes_is_error_with_the_failing_path_and_the_gate_holds() -> None:
    results = _call_all()
    ok = verified(results["c1"], DELETE_OUTPUT)
    assert ok.ok and ok.value["deleted"] is True and not results["c1"].is_error
    for customer, path in (("c502", "/"), ("c3", "/deleted"), ("c4", "/deleted_at")):
        result = results[customer]
        assert result.is_error and result.structured_content is None
        assert f"Output failed schema at {path}:" in result.content[0].text
        gate = verified(result, DELETE_OUTPUT)
        assert not gate.ok and gate.value is None


def test_gate_never_reads_the_text_copy() -> None:
    claims = {"isError": False, "content": [{"type": "text", "text": '{"deleted": true}'}]}
    assert not verified(claims, DELETE_OUTPUT).ok  # prose or JSON text is not evidence of success
    unchecked = {"isError": False, "structuredContent": {"deleted": "yes", "customer_id": "c",
                                                         "deleted_at": "2026-11-23T12:00:00Z"},
                 "content": [{"type": "text", "text": "Done, customer removed."}]}
    gate = verified(unchecked, DELETE_OUTPUT)  # a server that skipped finish_tool_result
    assert not gate.ok and gate.path == "/deleted"
