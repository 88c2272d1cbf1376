"""`corral bench mediation`: the same dev schemas, each with a derived semantic rule, mediated in every mode
against a corral; per mode: success rate, attempts, tokens per success, failure classes."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
from jsonschema.exceptions import SchemaError

from corral.benchmarks.harness import ServerBenchConfig, write_json
from corral.benchmarks.mediation.rules import derive_rule
from corral.benchmarks.serve.runner import machine_notes
from corral.benchmarks.serve.server_proc import corral_server
from corral.benchmarks.serve.workload import candidate_cases
from corral.mediation import Capabilities, MediationError, Mediator, MemorySink, Mode, OutputSchema, RepairPolicy, Rule
from corral.mediation.modes import fetch_corral_capabilities

MAX_SCHEMA_CHARS = 4000  # json_mode and contract_only spell the schema out in the prompt


@dataclass(frozen=True)
class MediationBenchConfig(ServerBenchConfig):
    schemas: int = 200
    modes: tuple[str, ...] = tuple(str(m) for m in Mode)
    markers: bool = False
    max_attempts: int = 3
    concurrency: int = 4
    max_tokens: int = 512
    model: str | None = None

    def __post_init__(self) -> None:
        if self.schemas < 1 or self.concurrency < 1 or self.max_tokens < 1 or self.max_attempts < 1:
            raise ValueError("--schemas, --concurrency, --max-tokens and --max-attempts must be positive")
        unknown = set(self.modes) - {str(m) for m in Mode}
        if unknown:
            raise ValueError(f"unknown mode(s) {', '.join(sorted(unknown))}; choose from {', '.join(Mode)}")


@dataclass(frozen=True)
class Case:
    case_id: str
    schema: dict[str, Any]
    rule: Rule


@dataclass
class CallResult:
    case_id: str
    mode: str  # the mode asked for
    declared: bool  # corral compiles the schema (POST /v1/grammars)
    ok: bool
    attempts: int
    mode_used: str | None
    failure_class: str | None  # terminal failure; None on success
    round_failures: list[str | None]
    tokens: int
    latency_s: float


def select_cases(data: Path, wanted: int) -> list[Case]:
    """The serving benchmark's deterministic spread over the subsets, keeping schemas a rule derives from."""
    picked: list[Case] = []
    for case in candidate_cases(data, wanted * 4):  # spares: a rule does not derive from every schema
        schema = case.schema
        if not isinstance(schema, dict) or len(json.dumps(schema)) > MAX_SCHEMA_CHARS:
            continue
        rule = derive_rule(schema)
        if rule is None or not _valid_schema(schema):
            continue
        picked.append(Case(f"{case.subset}/{case.name}", schema, rule))
        if len(picked) == wanted:
            break
    return picked


def _valid_schema(schema: dict[str, Any]) -> bool:
    try:
        OutputSchema.from_json_schema(schema)
    except SchemaError:
        return False
    return True


async def _declared(http: httpx.AsyncClient, base_url: str, case: Case) -> bool:
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": case.schema}}}
    answer = await http.post(f"{base_url}/v1/grammars", json=body)
    return answer.status_code == 200


async def _mediate(client: openai.AsyncOpenAI, caps: Capabilities, case: Case, mode: Mode, declared: bool,
                   config: MediationBenchConfig) -> CallResult:
    sink = MemorySink()
    mediator: Mediator[Any] = Mediator(
        OutputSchema.from_json_schema(case.schema, name="result"), model=config.model or "default",
        async_client=client, capabilities=caps, provider="corral", mode=mode, markers=config.markers,
        validators=[case.rule], repair=RepairPolicy(max_attempts=config.max_attempts), sink=sink)
    started = time.perf_counter()
    ok, failure, used = True, None, None
    try:
        result = await mediator.acall("Produce an example value.", temperature=0, max_tokens=config.max_tokens)
        used = str(result.mode)
    except MediationError as exc:
        ok, failure = False, str(exc.failure_class)
    rounds = sink.rounds
    return CallResult(case.case_id, str(mode), declared, ok, len(rounds), used or (rounds[-1].mode if rounds else None),
                      failure, [r.failure_class for r in rounds],
                      sum(r.prompt_tokens + r.completion_tokens for r in rounds), time.perf_counter() - started)


async def drive(config: MediationBenchConfig, base_url: str, cases: Sequence[Case],
                on_result: Callable[[CallResult], None]) -> list[CallResult]:
    caps = fetch_corral_capabilities(f"{base_url}/v1")
    gate = asyncio.Semaphore(config.concurrency)
    async with httpx.AsyncClient(timeout=600) as http:
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=600)
        declared = await asyncio.gather(*(_declared(http, base_url, c) for c in cases))

        async def one(case: Case, mode: Mode, is_declared: bool) -> CallResult:
            async with gate:
                result = await _mediate(client, caps, case, mode, is_declared, config)
            on_result(result)
            return result

        jobs = [one(c, Mode(m), d) for m in config.modes for c, d in zip(cases, declared, strict=True)]
        return list(await asyncio.gather(*jobs))


def summarize(results: Sequence[CallResult], *, declared_only: bool = False) -> dict[str, dict[str, Any]]:
    by_mode: dict[str, dict[str, Any]] = {}
    for mode in dict.fromkeys(r.mode for r in results):
        rows = [r for r in results if r.mode == mode and (r.declared or not declared_only)]
        wins = [r for r in rows if r.ok]
        by_mode[mode] = {
            "calls": len(rows),
            "success": len(wins),
            "success_rate": round(len(wins) / len(rows), 4) if rows else None,
            "success_within_2": sum(1 for r in wins if r.attempts <= 2),
            "mean_attempts": round(sum(r.attempts for r in rows) / len(rows), 3) if rows else None,
            "mean_attempts_success": round(sum(r.attempts for r in wins) / len(wins), 3) if wins else None,
            # Every token spent in this mode (failed calls included) per validated value.
            "tokens_per_success": round(sum(r.tokens for r in rows) / len(wins), 1) if wins else None,
            "terminal_failures": dict(Counter(r.failure_class for r in rows if r.failure_class).most_common()),
            "round_failures": dict(Counter(f for r in rows for f in r.round_failures if f).most_common()),
            "modes_used": dict(Counter(r.mode_used for r in rows if r.mode_used).most_common()),
        }
    return by_mode


def run_mediation_bench(config: MediationBenchConfig, on_result: Callable[[CallResult], None]) -> dict[str, Any]:
    started = time.perf_counter()
    cases = select_cases(config.data, config.schemas)
    with corral_server(config.server, config.server_args, config.out / "server.log") as (base_url, command):
        results = asyncio.run(drive(config, base_url, cases, on_result))
    report: dict[str, Any] = {
        "config": config.as_dict(),
        "server": config.server_notes(base_url, command),
        "notes": "Each schema gets a rule derived from it (a number property non-negative or a string property "
                 "non-empty; corral/benchmarks/mediation/rules.py) as its SemanticValidator, with the rule's decode "
                 "hint. "
                 "Greedy decoding; RepairPolicy(max_attempts) with one structural retry. declared = corral "
                 "compiles the schema (POST /v1/grammars).",
        "schemas": len(cases),
        "declared": sum(1 for r in results if r.declared) // max(1, len(config.modes)),
        "summary": summarize(results),
        "summary_declared": summarize(results, declared_only=True),
        "wall_s": round(time.perf_counter() - started, 1),
        "machine": machine_notes(),
        "results": [asdict(r) for r in results],
    }
    report["files"] = [str(write_json(config.out, report))]
    return report
