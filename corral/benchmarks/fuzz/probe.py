"""Send one raw request over a kept-alive httpx connection and judge what came back with the oracle."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx

from corral.benchmarks.fuzz.oracle import error_shape_problem, fail_open_problems

FINISH_FIELD = "corral_finish_reason"  # corral's precise finish reason beside OpenAI's


@dataclass
class Exchange:
    status: int
    problems: list[str] = field(default_factory=list)
    connection: object = None  # the client-side address of the connection it went over
    streamed: bool = False


def connection_of(response: httpx.Response) -> object:
    stream = response.extensions.get("network_stream")
    return stream.get_extra_info("client_addr") if stream is not None else None


def exchange(client: httpx.Client, method: str, path: str, content: bytes | None, headers: dict[str, str],
             request: Any) -> Exchange:
    """Send it, read the whole answer (JSON or SSE), and list every way it breaks the oracle."""
    with client.stream(method, path, content=content, headers=headers) as response:
        raw = response.read()
        result = Exchange(response.status_code, connection=connection_of(response))
        kind = response.headers.get("content-type", "")
    if result.status >= 500:
        result.problems.append(f"server error {result.status}: {raw[:300]!r}")
        return result
    if "text/event-stream" in kind:
        result.streamed = True
        result.problems += judge_stream(request, raw.decode("utf-8", errors="replace"))
        return result
    try:
        body = json.loads(raw) if raw else None
    except ValueError:
        body = None
        if result.status >= 400 or path.startswith("/v1/"):
            result.problems.append(f"{result.status} answer is not JSON: {raw[:200]!r}")
            return result
    if result.status >= 400:
        problem = error_shape_problem(result.status, body)
        if problem:
            result.problems.append(problem)
    elif result.status == 200:
        result.problems += fail_open_problems(request, body) + engine_error_problems(body)
    return result


def engine_error_problems(body: Any) -> list[str]:
    """Choices the engine failed (`corral_finish_reason: "error"`): no input may fail the engine."""
    choices = body.get("choices") if isinstance(body, dict) else None
    return [f"engine error in choices[{i}]: {choice.get('message') or choice.get('text')!r:.200}"
            for i, choice in enumerate(choices or []) if isinstance(choice, dict)
            and choice.get(FINISH_FIELD) == "error"]


def judge_stream(request: Any, text: str) -> list[str]:
    """A stream ends with `[DONE]` or an error event in OpenAI's shape; its assembled answers keep the
    request's constraint."""
    events = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
    if not events:
        return ["stream without events"]
    problems: list[str] = []
    contents: dict[int, str] = {}
    finishes: dict[int, Any] = {}
    calls: dict[int, dict[int, dict[str, str]]] = {}
    errored = False
    for event in events:
        if event == "[DONE]":
            continue
        try:
            chunk = json.loads(event)
        except ValueError:
            problems.append(f"stream event is not JSON: {event[:200]}")
            continue
        if isinstance(chunk, dict) and "error" in chunk:
            errored = True
            problem = error_shape_problem(200, chunk)
            if problem:
                problems.append(f"stream error event: {problem}")
            continue
        for choice in chunk.get("choices") or []:
            _absorb(choice, contents, finishes, calls)
    if events[-1] != "[DONE]" and not errored and not _responses_end(events[-1]):
        problems.append("stream ended without [DONE] or an error event")
    choices = []
    for index in sorted(set(contents) | set(finishes)):
        tool_calls = [{"function": call} for _, call in sorted(calls.get(index, {}).items())]
        message = {"content": contents.get(index, ""), "tool_calls": tool_calls or None}
        choices.append({"index": index, "finish_reason": finishes.get(index), "message": message})
    return problems + fail_open_problems(request, {"choices": choices})


# A Responses API stream has no `[DONE]`: its last event is one of these, with the whole response.
RESPONSES_ENDS = frozenset({"response.completed", "response.incomplete", "response.failed"})


def _responses_end(event: str) -> bool:
    try:
        chunk = json.loads(event)
    except ValueError:
        return False
    return isinstance(chunk, dict) and chunk.get("type") in RESPONSES_ENDS


def _absorb(choice: dict[str, Any], contents: dict[int, str], finishes: dict[int, Any],
            calls: dict[int, dict[int, dict[str, str]]]) -> None:
    index = int(choice.get("index", 0))
    delta = choice.get("delta") or {}
    text = delta.get("content") if "delta" in choice else choice.get("text")
    if isinstance(text, str):
        contents[index] = contents.get(index, "") + text
    for call in delta.get("tool_calls") or []:
        slot = calls.setdefault(index, {}).setdefault(int(call.get("index", 0)), {"name": "", "arguments": ""})
        function = call.get("function") or {}
        slot["name"] += function.get("name") or ""
        slot["arguments"] += function.get("arguments") or ""
    if choice.get("finish_reason") is not None:
        finishes[index] = choice["finish_reason"]
