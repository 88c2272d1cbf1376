"""Orchestration of `corral bench tools`: start (or reach) a server, probe tool support, send every schema as
a required function call, judge, report."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from corral.benchmarks.harness import ServerBenchConfig, write_json
from corral.benchmarks.jsonschemabench.dataset import SchemaCase
from corral.benchmarks.serve.client import make_client, post_chat
from corral.benchmarks.serve.runner import Progress, Silent, machine_notes
from corral.benchmarks.serve.server_proc import corral_server
from corral.benchmarks.serve.workload import candidate_cases
from corral.benchmarks.tools.judge import ToolResult, judge_answer, summarize
from corral.benchmarks.tools.report import outcome_plot, per_subset
from corral.benchmarks.tools.workload import TOOL_CHOICES, tools_request

PROBE_SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
                "additionalProperties": False}


class ToolsUnsupported(RuntimeError):
    """The server does not answer a tools request with a tool call (refuses the field or ignores it)."""


@dataclass(frozen=True)
class ToolsBenchConfig(ServerBenchConfig):
    schemas: int = 200
    concurrency: int = 4
    max_tokens: int = 256
    tool_choice: str = "required"
    model: str | None = None
    api_key: str | None = None
    request_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.schemas < 1:
            raise ValueError(f"--schemas must be positive, got {self.schemas}")
        if self.concurrency < 1:
            raise ValueError(f"--concurrency must be positive, got {self.concurrency}")
        if self.max_tokens < 1:
            raise ValueError(f"--max-tokens must be positive, got {self.max_tokens}")
        if self.tool_choice not in TOOL_CHOICES:
            raise ValueError(f"--tool-choice must be one of {', '.join(TOOL_CHOICES)}, got {self.tool_choice!r}")


def select_cases(data: Path, wanted: int) -> list[SchemaCase]:
    """The first `wanted` of the serving benchmark's deterministic spread over the subsets; schemas the server
    refuses are counted, not replaced (the count of tried schemas is the denominator)."""
    return candidate_cases(data, wanted)[:wanted]


async def probe(client: httpx.AsyncClient, config: ToolsBenchConfig) -> str | None:
    """One small required call. None when the server answers it with tool_calls; else why not."""
    case = SchemaCase("probe", "probe.json", PROBE_SCHEMA, ())
    reply = await post_chat(client, tools_request(case, max_tokens=config.max_tokens, tool_choice="required",
                                                  model=config.model))
    if reply.payload is None:
        return f"a tools request got HTTP {reply.http_status}: {reply.error}"
    message = reply.payload["choices"][0].get("message") or {}
    if not message.get("tool_calls"):
        return ("a tool_choice='required' request came back without tool_calls (finish_reason "
                f"{reply.payload['choices'][0].get('finish_reason')!r}): the server ignores `tools`")
    return None


async def run_cases(client: httpx.AsyncClient, cases: Sequence[SchemaCase], config: ToolsBenchConfig,
                    on_done: Callable[[ToolResult], None]) -> list[ToolResult]:
    gate = asyncio.Semaphore(config.concurrency)

    async def one(case: SchemaCase) -> ToolResult:
        async with gate:
            reply = await post_chat(client, tools_request(case, max_tokens=config.max_tokens,
                                                          tool_choice=config.tool_choice, model=config.model))
        if reply.payload is None:
            result = ToolResult(case.case_id, reply.status, reply.http_status, client_ms=reply.client_ms,
                                error=reply.error)
        else:
            result = judge_answer(case, reply.payload, reply.client_ms)
        on_done(result)
        return result

    return list(await asyncio.gather(*(one(c) for c in cases)))


async def drive(config: ToolsBenchConfig, base_url: str, cases: Sequence[SchemaCase], progress: Progress
                ) -> list[ToolResult]:
    async with make_client(base_url, config.request_timeout_s, config.concurrency, config.api_key) as client:
        reason = await probe(client, config)
        if reason is not None:
            raise ToolsUnsupported(f"{base_url} does not support tool calls: {reason}")
        progress.phase(f"tool calls (tool_choice={config.tool_choice})", len(cases))

        def done(r: ToolResult) -> None:
            verdict = "refused" if r.status == "refused" else (
                f"{sum(c.valid for c in r.calls)}/{len(r.calls)} valid calls" if r.status == "ok" else r.status)
            progress.advance(f"{r.case_id[:40]}: {verdict}")

        return await run_cases(client, cases, config, done)


def run_tools_bench(config: ToolsBenchConfig, progress: Progress | None = None) -> dict[str, Any]:
    """The whole benchmark; writes OUT/results.json and OUT/tool_calls.png. Raises ToolsUnsupported when
    the probe shows no tool support."""
    progress = progress or Silent()
    started = time.perf_counter()
    cases = select_cases(config.data, config.schemas)
    with corral_server(config.server, config.server_args, config.out / "server.log") as (base_url, server_command):
        results = asyncio.run(drive(config, base_url, cases, progress))
    summary = summarize(results)
    report: dict[str, Any] = {
        "config": {**config.as_dict(), "api_key": "(set)" if config.api_key else None},  # never the key itself
        "server": config.server_notes(base_url, server_command),
        "notes": "Each schema is the `parameters` of one function; tool_choice as configured. Every returned "
                 "call's `arguments` string is validated here with the full validator (Draft 2020-12 + "
                 "formats), not taken from the server. compliance = valid calls ÷ returned calls.",
        "summary": summary.as_dict(),
        "per_subset": per_subset(cases, results),
        "wall_s": time.perf_counter() - started,
        "machine": machine_notes(),
        "results": [asdict(r) for r in results],
    }
    report["files"] = [str(write_json(config.out, report)),
                       str(outcome_plot(report["per_subset"], config.out / "tool_calls.png"))]
    write_json(config.out, report)
    return report
