"""Orchestration of `corral bench quality`: reach (or start) corral, ask every item under every mode, then
the peer the same items, judge, summarise, write OUT/results.json and OUT/quality.png."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from corral.benchmarks.harness import write_json
from corral.benchmarks.quality.answers import Answer, judge
from corral.benchmarks.quality.bodies import (
    APIS,
    CORRAL_MODES,
    Mode,
    Sampling,
    check_tool_choice,
    corral_mode,
    peer_modes,
    request,
)
from corral.benchmarks.quality.report import quality_plot, summarise
from corral.benchmarks.quality.suites import load_tasks
from corral.benchmarks.quality.tasks import Item, Task
from corral.benchmarks.serve.client import make_client, post
from corral.benchmarks.serve.peer import resolve_peer_model
from corral.benchmarks.serve.runner import Progress, Silent, machine_notes
from corral.benchmarks.serve.server_proc import REPO, corral_server

# ManagedServer serves corral-tiny unless told a model: accuracy needs the real default model.
DEFAULT_SERVER_ARGS = "--model gemma-3-270m"


@dataclass(frozen=True)
class QualityBenchConfig:
    out: Path
    server: str | None = None
    server_args: str = DEFAULT_SERVER_ARGS
    api: str = "completions"
    modes: tuple[str, ...] = CORRAL_MODES
    tasks: tuple[str, ...] = ()  # empty: every suite
    items: int | None = None  # per task; None: all of each suite
    shots: int = 1
    tool_choice: str = "required"  # what the constrained modes of a tool task send (unconstrained: "none")
    max_tokens: int = 128
    temperature: float = 0.0
    concurrency: int = 4
    model: str | None = None  # the `model` field sent to corral (default: none)
    api_key: str | None = None
    extra_body: dict[str, Any] | None = None  # merged into every corral request: a lever under measurement
    peer_url: str | None = None
    peer_model: str | None = None  # default: the first id its /v1/models lists
    peer_constraint: str = "response_format"
    peer_api_key: str | None = None
    request_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.api not in APIS:
            raise ValueError(f"--api must be one of {', '.join(APIS)}, got {self.api!r}")
        if not self.modes:
            raise ValueError("--modes needs at least one mode")
        for name in self.modes:
            corral_mode(name)
        peer_modes(self.peer_constraint)
        check_tool_choice(self.tool_choice)
        if self.shots not in (0, 1):
            raise ValueError(f"--shots must be 0 or 1, got {self.shots}")
        if self.max_tokens < 1 or self.concurrency < 1:
            raise ValueError("--max-tokens and --concurrency must be positive")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"--temperature must lie in [0, 2], got {self.temperature}")

    def as_dict(self) -> dict[str, Any]:
        hidden = {"api_key": "(set)" if self.api_key else None,  # never the keys themselves
                  "peer_api_key": "(set)" if self.peer_api_key else None}
        return {**asdict(self), "out": str(self.out), **hidden}


@dataclass(frozen=True)
class Side:
    """A server the benchmark asks: its name in the results, its modes and how its requests are spelled."""

    name: str
    modes: tuple[Mode, ...]
    model: str | None = None
    extra: dict[str, Any] | None = None


async def ask_all(base_url: str, api_key: str | None, side: Side, tasks: Sequence[Task], config: QualityBenchConfig,
                  progress: Progress) -> list[Answer]:
    """Every item of every task under every mode of `side`, `concurrency` in flight; answers in job order
    (task, mode, item), so a task's mode runs together and its grammar compiles once."""
    jobs: list[tuple[Task, Item, Mode]] = [(t, i, m) for t in tasks for m in side.modes for i in t.items]
    sampling = Sampling(config.max_tokens, config.temperature)
    gate = asyncio.Semaphore(config.concurrency)
    progress.phase(f"{side.name}: {len(tasks)} tasks × {len(side.modes)} modes", len(jobs))
    async with make_client(base_url, config.request_timeout_s, config.concurrency, api_key) as client:

        async def one(task: Task, item: Item, mode: Mode) -> Answer:
            api, path, body = request(task, item, mode, api=config.api, shots=config.shots, sampling=sampling,
                                      model=side.model, extra=side.extra, tool_choice=config.tool_choice)
            async with gate:
                reply = await post(client, path, body)
            answer = judge(task, item, server=side.name, mode=mode.name, api=api, reply=reply,
                           tool_choice=body.get("tool_choice"))
            progress.advance(f"{task.name}/{mode.name}: {'right' if answer.exact else answer.finish}")
            return answer

        return list(await asyncio.gather(*(one(*job) for job in jobs)))


def source_revision() -> str | None:
    """`git describe --always --dirty` of the tree the benchmark runs from: a table names the code it measured."""
    try:
        done = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True,
                              timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def run_quality_bench(config: QualityBenchConfig, progress: Progress | None = None) -> dict[str, Any]:
    """The whole benchmark; returns the report it writes to OUT/results.json (and OUT/quality.png)."""
    progress = progress or Silent()
    started = time.perf_counter()
    tasks = load_tasks(list(config.tasks) or None, config.items)
    # The peer is checked first: an unreachable peer fails before corral starts.
    peer_model = (resolve_peer_model(config.peer_url, config.peer_model, config.peer_api_key)
                  if config.peer_url else None)
    corral = Side("corral", tuple(corral_mode(m) for m in config.modes), config.model, config.extra_body)
    with corral_server(config.server, config.server_args, config.out / "server.log") as (base_url, command):
        answers = asyncio.run(ask_all(base_url, config.api_key, corral, tasks, config, progress))
    peer: dict[str, Any] | None = None
    if config.peer_url:
        side = Side("peer", peer_modes(config.peer_constraint), peer_model)
        answers += asyncio.run(ask_all(config.peer_url, config.peer_api_key, side, tasks, config, progress))
        peer = {"url": config.peer_url, "model": peer_model, "constraint": config.peer_constraint}
    report: dict[str, Any] = {
        "config": config.as_dict(),
        "server": {"url": base_url, "started_by_benchmark": config.server is None, "command": command},
        "peer": peer,
        "tasks": {t.name: {"kind": t.kind, "description": t.description, "items": len(t.items),
                           "fields": [f.name for f in t.fields], "schema": t.schema or None,
                           "tools": [tool["function"]["name"] for tool in t.tools] or None} for t in tasks},
        "summary": summarise(answers),
        "wall_s": time.perf_counter() - started,
        "revision": source_revision(),
        "machine": machine_notes(),
        "answers": [asdict(a) for a in answers],
    }
    report["files"] = [str(config.out / "results.json"), str(quality_plot(report["summary"],
                                                                         config.out / "quality.png"))]
    write_json(config.out, report)
    return report
