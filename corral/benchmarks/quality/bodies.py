"""What the benchmark sends: one request per item and mode, to corral or a peer.

A mode is how the answer is constrained: `unconstrained` (free text), corral's backends through
`structured_outputs: {json | choice, backend}`, or the field a peer takes (vLLM: `structured_outputs`;
llama.cpp's llama-server: its own top-level `json_schema`, read on /v1/completions and chat alike, or OpenAI's
`response_format` json_schema, which it reads on chat only and ignores on /v1/completions). A tool
task always goes to /v1/chat/completions (tools exist only there): constrained modes send `--tool-choice`
(`required`, a call is forced; or `auto`, the model may answer in words instead), unconstrained sends the same
tools with `tool_choice: "none"`, so the prompt is the same and the answer is free text."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from corral.benchmarks.quality.tasks import Item, Task

APIS = ("completions", "chat")
BACKENDS = ("xgrammar", "llguidance", "auto")
CORRAL_MODES = ("unconstrained", *BACKENDS)
PEER_CONSTRAINTS = ("response_format", "structured_outputs", "json_schema")
TOOL_CHOICES = ("required", "auto")  # what a constrained mode of a tool task sends
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
# A base model asked for one line of JSON goes on to write the next example; a user stops it at the blank line.
# Constrained answers get no stop string: the grammar ends them, and a stop string could cut one.
UNCONSTRAINED_STOP = ["\n\n"]


@dataclass(frozen=True)
class Mode:
    """`field` None: unconstrained; else the request field that carries the constraint, with `backend` when
    the server takes one (corral: structured_outputs.backend)."""

    name: str
    field: str | None = None
    backend: str | None = None

    @property
    def constrained(self) -> bool:
        return self.field is not None


def corral_mode(name: str) -> Mode:
    if name == "unconstrained":
        return Mode(name)
    if name in BACKENDS:
        return Mode(name, "structured_outputs", name)
    raise ValueError(f"--modes: unknown mode {name!r}; the modes are {', '.join(CORRAL_MODES)}")


def peer_modes(constraint: str) -> tuple[Mode, ...]:
    if constraint not in PEER_CONSTRAINTS:
        raise ValueError(f"--peer-constraint must be one of {', '.join(PEER_CONSTRAINTS)}, got {constraint!r}")
    return Mode("unconstrained"), Mode(constraint, constraint)


@dataclass(frozen=True)
class Sampling:
    max_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0


def constraint_fields(task: Task, mode: Mode) -> dict[str, Any]:
    """The body fields that ask for the task's shape under `mode` (none when unconstrained)."""
    if mode.field is None:
        return {}
    backend = {"backend": mode.backend} if mode.backend else {}
    if task.kind == "tool":  # the tools carry the shape; corral still takes the backend that enforces it
        return {"structured_outputs": backend} if backend else {}
    if mode.field == "structured_outputs":
        key: dict[str, Any] = {"choice": list(task.labels)} if task.kind == "choice" else {"json": task.schema}
        return {"structured_outputs": {**key, **backend}}
    if mode.field == "response_format":
        return {"response_format": {"type": "json_schema", "json_schema": {
            "name": task.name, "schema": task.schema, "strict": True}}}
    if mode.field == "json_schema":
        return {"json_schema": task.schema}
    raise ValueError(f"unknown constraint field {mode.field!r}")


def check_tool_choice(tool_choice: str) -> None:
    if tool_choice not in TOOL_CHOICES:
        raise ValueError(f"--tool-choice must be one of {', '.join(TOOL_CHOICES)}, got {tool_choice!r}")


def request(task: Task, item: Item, mode: Mode, *, api: str, shots: int, sampling: Sampling,
            model: str | None = None, extra: dict[str, Any] | None = None,
            tool_choice: str = "required") -> tuple[str, str, dict[str, Any]]:
    """(api used, path, body) for one item under one mode; `tool_choice` is what a tool task's constrained
    modes send."""
    if api not in APIS:
        raise ValueError(f"--api must be one of {', '.join(APIS)}, got {api!r}")
    check_tool_choice(tool_choice)
    used = "chat" if task.kind == "tool" else api
    body: dict[str, Any] = {"max_tokens": sampling.max_tokens, "temperature": sampling.temperature,
                            "seed": sampling.seed}
    if used == "completions":
        body["prompt"] = task.completion_prompt(item, shots)
    else:
        body["messages"] = task.chat_messages(item, shots)
    if task.kind == "tool":
        body.update(tools=list(task.tools), tool_choice=tool_choice if mode.constrained else "none",
                    parallel_tool_calls=False)
    elif not mode.constrained and used == "completions":
        body["stop"] = list(UNCONSTRAINED_STOP if task.kind == "json" else ["\n"])
    body.update(constraint_fields(task, mode))
    if model is not None:
        body["model"] = model
    body.update(extra or {})
    return used, PATHS[used], body
