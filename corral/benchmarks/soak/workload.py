"""The soak's requests: ordinary constrained ones (every kind, streamed or not) and the hostile ones that run
beside them (client disconnects, client cancels, compile bombs, malformed constraints)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ORDINARY_KINDS = ("json_schema", "choice", "regex", "grammar", "tools")
HOSTILE_KINDS = ("disconnect", "cancel", "compile_bomb", "malformed")
# Per 20 requests of the hostile phase: 6 hostile, 14 ordinary.
HOSTILE_PATTERN = ("disconnect", "disconnect", "cancel", "cancel", "compile_bomb", "malformed")
PATTERN_LENGTH = 20

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 16}}, "required": ["city"],
    "additionalProperties": False}}}


@dataclass(frozen=True)
class SoakRequest:
    kind: str  # one of ORDINARY_KINDS or HOSTILE_KINDS
    body: dict[str, Any]
    stream: bool

    @property
    def ordinary(self) -> bool:
        return self.kind in ORDINARY_KINDS


def ordinary(index: int, max_tokens: int) -> SoakRequest:
    """The index-th ordinary request: kinds in turn, every other pass streamed."""
    kind = ORDINARY_KINDS[index % len(ORDINARY_KINDS)]
    stream = (index // len(ORDINARY_KINDS)) % 2 == 1
    body: dict[str, Any] = {"model": "corral-tiny", "max_tokens": max_tokens, "stream": stream,
                            "messages": [{"role": "user", "content": f"request {index}: answer briefly"}]}
    if kind == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    elif kind == "choice":
        body["structured_outputs"] = {"choice": ["red", "green", "blue"]}
    elif kind == "regex":
        body["structured_outputs"] = {"regex": "[0-9]{3}-[0-9]{4}"}
    elif kind == "grammar":
        body["structured_outputs"] = {"grammar": 'root ::= "yes" | "no" | "maybe " [0-9]'}
    else:
        body.update(tools=[TOOL], tool_choice="required")
    return SoakRequest(kind, body, stream)


def compile_bomb(index: int) -> str:
    """A regex that compiles past any deadline (as in tests/e2e/test_compile_timeout_http.py); a distinct
    literal prefix per request, so the server's cached refusal does not answer it at once."""
    return f"b{index}" + "".join(f"[a-z]{{1,{i + 50}}}" for i in range(300))


def hostile(kind: str, index: int, max_tokens: int) -> SoakRequest:
    base = ordinary(index, max_tokens)
    body = dict(base.body)
    if kind == "disconnect":  # streamed, the client hangs up after the first event
        return SoakRequest(kind, {**body, "stream": True}, True)
    if kind == "cancel":  # non-streamed, the client gives up before the answer
        return SoakRequest(kind, {**body, "stream": False, "ignore_eos": True}, False)
    body.pop("response_format", None)
    body.pop("tools", None)
    body.pop("tool_choice", None)
    if kind == "compile_bomb":
        return SoakRequest(kind, {**body, "stream": False, "structured_outputs": {"regex": compile_bomb(index)}}, False)
    return SoakRequest(kind, {**body, "stream": False, "structured_outputs": {"json": {"type": "object", "properties": {
        "a": {"type": 12}}}}}, False)


def hostile_phase(count: int, max_tokens: int) -> list[SoakRequest]:
    """`count` requests: HOSTILE_PATTERN's kinds in the first slots of every PATTERN_LENGTH, ordinary ones
    in the rest."""
    requests = []
    for i in range(count):
        slot = i % PATTERN_LENGTH
        kind = HOSTILE_PATTERN[slot] if slot < len(HOSTILE_PATTERN) else None
        requests.append(hostile(kind, i, max_tokens) if kind else ordinary(i, max_tokens))
    return requests
