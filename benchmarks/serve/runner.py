"""Orchestration: select and warm up schemas, run each (mode, concurrency), run the baseline, report."""

from __future__ import annotations

import asyncio
import logging
import os
import platform
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx

from benchmarks.jsonschemabench.dataset import SchemaCase
from benchmarks.serve.client import make_client, run_level, send
from benchmarks.serve.report import throughput_plot, write_json
from benchmarks.serve.server_proc import ManagedServer, wait_healthy
from benchmarks.serve.stats import RequestResult, headline_ratios, summarize_run
from benchmarks.serve.workload import candidate_cases

log = logging.getLogger(__name__)

MODES = ("constrained", "unconstrained")


@dataclass(frozen=True)
class ServeBenchConfig:
    data: Path
    out: Path
    server: str | None = None
    server_args: str = ""
    schemas: int = 32
    concurrency: tuple[int, ...] = (1, 4, 16)
    max_tokens: int = 64
    requests_per_level: int | None = None  # default: one per schema
    backend: str = "auto"
    baseline: bool = True
    request_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"--concurrency needs positive levels, got {self.concurrency}")
        if self.max_tokens < 2:
            raise ValueError("--max-tokens must be at least 2 (TPOT needs two tokens)")
        if self.requests_per_level is not None and self.requests_per_level < 1:
            raise ValueError("--requests-per-level must be positive")


class Progress(Protocol):
    """What the runner reports while it works (the CLI draws a rich progress bar from it)."""

    def phase(self, label: str, total: int) -> None: ...

    def advance(self, detail: str = "") -> None: ...


class _Silent:
    def phase(self, label: str, total: int) -> None:
        log.info("%s (%d)", label, total)

    def advance(self, detail: str = "") -> None:
        pass


@dataclass
class Selection:
    cases: list[SchemaCase] = field(default_factory=list)
    refused: list[dict[str, Any]] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)


async def select_and_warm(client: httpx.AsyncClient, config: ServeBenchConfig, progress: Progress) -> Selection:
    """Send each candidate schema once, constrained: this fills the server's compile cache (so timed runs
    measure decoding, not compiling) and finds the schemas it refuses (400), which are replaced by spares."""
    candidates = candidate_cases(config.data, config.schemas)
    selection = Selection()
    progress.phase("warm-up (compile every schema once)", config.schemas)
    width = max(config.concurrency)
    cursor = 0
    while len(selection.cases) < config.schemas and cursor < len(candidates):
        batch = candidates[cursor: cursor + config.schemas - len(selection.cases)]
        cursor += len(batch)
        results, _ = await run_level(client, batch, mode="constrained", concurrency=width,
                                     max_tokens=config.max_tokens, backend=config.backend)
        for case, result in zip(batch, results, strict=True):
            if result.status == "ok":
                selection.cases.append(case)
                progress.advance(case.case_id)
            elif result.status == "refused":
                selection.refused.append({"schema": case.case_id, "error": result.error})
            else:
                selection.errors.append({"schema": case.case_id, "error": result.error})
    if len(selection.cases) < config.schemas:
        log.warning("only %d of %d schemas were accepted", len(selection.cases), config.schemas)
    # A few unconstrained requests too, so the first timed unconstrained run does not pay any first-use cost.
    for case in selection.cases[:2]:
        await send(client, case, mode="unconstrained", concurrency=1, max_tokens=config.max_tokens,
                   backend=config.backend)
    return selection


async def drive(config: ServeBenchConfig, base_url: str, progress: Progress
                ) -> tuple[Selection, list[dict[str, Any]], list[RequestResult]]:
    client = make_client(base_url, config.request_timeout_s, max(config.concurrency))
    async with client:
        selection = await select_and_warm(client, config, progress)
        if not selection.cases:
            raise RuntimeError("the server accepted none of the selected schemas")
        n = config.requests_per_level or len(selection.cases)
        workload = [selection.cases[i % len(selection.cases)] for i in range(n)]
        runs: list[dict[str, Any]] = []
        everything: list[RequestResult] = []
        for level in config.concurrency:
            for mode in MODES:
                progress.phase(f"{mode} @ {level}", n)
                results, wall_s = await run_level(
                    client, workload, mode=mode, concurrency=level, max_tokens=config.max_tokens,
                    backend=config.backend,
                    on_done=lambda r: progress.advance(f"{r.finish_reason or r.status} {r.completion_tokens} tok"))
                runs.append(summarize_run(mode, level, results, wall_s))
                everything += results
    return selection, runs, everything


def machine_notes() -> dict[str, Any]:
    import torch

    return {
        "cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(), "loadavg_at_end": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


def run_serve_bench(config: ServeBenchConfig, progress: Progress | None = None) -> dict[str, Any]:
    """The whole benchmark; writes OUT/results.json and OUT/throughput.png and returns the results."""
    progress = progress or _Silent()
    started = time.perf_counter()
    managed: AbstractContextManager[Any] = (
        nullcontext() if config.server else ManagedServer(config.server_args, config.out / "server.log"))
    with managed as server:
        base_url = config.server.rstrip("/") if config.server else server.url
        if config.server:
            wait_healthy(base_url, 10.0)
        selection, runs, requests = asyncio.run(drive(config, base_url, progress))
        server_command = None if config.server else server.command
    baseline: dict[str, Any] | None = None
    if config.baseline:
        # After the server runs (and after it stopped, when the benchmark started it): the two never share
        # the CPU.
        baseline = _baseline(selection.cases, config, progress)
    ratios = headline_ratios(runs, baseline)
    results: dict[str, Any] = {
        "config": {**asdict(config), "data": str(config.data), "out": str(config.out)},
        "server": {"url": base_url, "started_by_benchmark": config.server is None, "command": server_command},
        "schemas": {"requested": config.schemas, "used": [c.case_id for c in selection.cases],
                    "refused": selection.refused, "errors": selection.errors},
        "notes": "Every schema was sent once before timing (compile cache warm), so timed runs exclude compile "
                 "time. Latencies are the server's per-request timings; throughput is completion tokens over "
                 "the run's wall time as the client saw it.",
        "runs": runs,
        "baseline": baseline,
        "ratios": ratios,
        "wall_s": time.perf_counter() - started,
        "machine": machine_notes(),
        "requests": [asdict(r) for r in requests],
    }
    results["files"] = [str(write_json(results, config.out)),
                        str(throughput_plot(runs, baseline, config.out / "throughput.png"))]
    write_json(results, config.out)
    return results


def _baseline(cases: list[SchemaCase], config: ServeBenchConfig, progress: Progress) -> dict[str, Any]:
    from benchmarks.serve.baseline import run_baseline

    n = config.requests_per_level or len(cases)
    workload = [cases[i % len(cases)] for i in range(n)] if cases else []
    return run_baseline(workload, config.max_tokens,
                        on_start=lambda total: progress.phase("baseline: HF generate + xgrammar", total),
                        on_done=progress.advance)
