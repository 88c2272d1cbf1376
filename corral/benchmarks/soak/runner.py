"""Run the soak against a server: warm-up, a quiet phase of ordinary requests, then the hostile phase
(ordinary requests with disconnects, cancels, compile bombs and malformed requests beside them), sampling
the server's memory and file descriptors and its /metrics at the boundaries."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

from corral.benchmarks.fuzz.probe import exchange
from corral.benchmarks.serve.stats import percentile
from corral.benchmarks.soak.procinfo import ProcessSample, sample
from corral.benchmarks.soak.workload import ORDINARY_KINDS, SoakRequest, hostile_phase, ordinary

log = logging.getLogger(__name__)

CANCEL_AFTER_S = 0.25
# A worker restart is counted by the robust branch's metric where the server has it, else by the compile
# timeouts (each one kills its worker, which is then replaced).
RESTART_METRICS = ("corral_compile_worker_restarts_total", 'corral_watchdog_trips_total{kind="compile_timeout"}')


@dataclass(frozen=True)
class SoakConfig:
    url: str
    requests: int = 1000
    concurrency: int = 16
    quiet_requests: int | None = None  # default: a quarter of `requests`, at least 32
    max_tokens: int = 48
    pid: int | None = None  # the server's process, for RSS and fds (None: not sampled)
    timeout_s: float = 300.0

    def quiet_count(self) -> int:
        return self.quiet_requests if self.quiet_requests is not None else max(32, self.requests // 4)


@dataclass
class Outcome:
    kind: str
    phase: str
    label: str  # 200, 400, 5xx, lost, fail_open, bad_shape, disconnected, cancelled, ...
    latency_s: float
    detail: str = ""


@dataclass
class SoakResult:
    outcomes: list[Outcome] = field(default_factory=list)
    samples: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    restarts: dict[str, float | None] = field(default_factory=dict)
    healthy_after: bool = False
    wall_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        by_class: dict[str, Counter[str]] = {}
        for o in self.outcomes:
            by_class.setdefault(f"{o.phase}/{o.kind}", Counter())[o.label] += 1
        quiet = self.latencies("quiet")
        loaded = self.latencies("hostile")
        bad = [o for o in self.outcomes if o.label in ("5xx", "lost", "fail_open", "bad_shape")]
        start, end = self.samples.get("after_warmup"), self.samples.get("end")
        growth = (end["rss_mb"] / start["rss_mb"] - 1) * 100 if start and end else None
        quiet_p99 = percentile(quiet, 99) if quiet else None
        loaded_p99 = percentile(loaded, 99) if loaded else None
        p99_ratio = loaded_p99 / quiet_p99 if quiet_p99 and loaded_p99 else None
        restarts = None
        if self.restarts.get("end") is not None:
            restarts = (self.restarts["end"] or 0.0) - (self.restarts.get("start") or 0.0)
        return {
            "requests": len(self.outcomes),
            "outcomes": {name: dict(counts) for name, counts in sorted(by_class.items())},
            "lost_or_5xx": sum(o.label in ("5xx", "lost") for o in self.outcomes),
            "fail_open": sum(o.label == "fail_open" for o in self.outcomes),
            "bad_shape": sum(o.label == "bad_shape" for o in self.outcomes),
            "problems": [f"{o.phase}/{o.kind} {o.label}: {o.detail}" for o in bad[:20]],
            "quiet_ms": _latency_ms(quiet), "hostile_ms": _latency_ms(loaded),
            "p99_ratio": None if p99_ratio is None else round(p99_ratio, 2),
            "rss_growth_pct": None if growth is None else round(growth, 2),
            "process": self.samples, "compile_worker_restarts": restarts,
            "healthy_after": self.healthy_after, "wall_s": round(self.wall_s, 1),
            "targets": {
                "no_lost_or_5xx": not bad,
                "rss_growth_under_5pct": None if growth is None else growth < 5.0,
                "hostile_p99_under_2x_quiet": None if p99_ratio is None else p99_ratio < 2.0,
            },
        }

    def latencies(self, phase: str) -> list[float]:
        return [o.latency_s for o in self.outcomes
                if o.phase == phase and o.kind in ORDINARY_KINDS and o.label == "200"]


def _latency_ms(values: list[float]) -> dict[str, float | int]:
    if not values:
        return {"n": 0}
    return {"n": len(values), "p50": round((percentile(values, 50) or 0.0) * 1000, 1),
            "p99": round((percentile(values, 99) or 0.0) * 1000, 1)}


def run_soak(config: SoakConfig, on_phase: Callable[[str, int], None] | None = None,
             on_done: Callable[[Outcome], None] | None = None) -> SoakResult:
    result = SoakResult()
    started = time.perf_counter()
    url = config.url.rstrip("/")
    warmup = [ordinary(i, config.max_tokens) for i in range(2 * len(ORDINARY_KINDS))]
    phases: list[tuple[str, list[SoakRequest], int]] = [
        ("warmup", warmup, 1),
        ("quiet", [ordinary(i, config.max_tokens) for i in range(config.quiet_count())], config.concurrency),
        ("hostile", hostile_phase(config.requests, config.max_tokens), config.concurrency),
    ]
    for name, requests, concurrency in phases:
        if on_phase is not None:
            on_phase(name, len(requests))
        result.outcomes += _run_phase(url, name, requests, concurrency, config.timeout_s, on_done)
        if name == "warmup":
            result.samples["after_warmup"] = _sample(config.pid)
            result.restarts["start"] = _restarts(url)
    result.samples["end"] = _sample(config.pid)
    result.restarts["end"] = _restarts(url)
    result.healthy_after = _healthy(url, config.max_tokens)
    result.wall_s = time.perf_counter() - started
    return result


def _sample(pid: int | None) -> dict[str, Any] | None:
    taken: ProcessSample | None = sample(pid) if pid is not None else None
    return taken.as_dict() if taken else None


def _run_phase(url: str, phase: str, requests: list[SoakRequest], concurrency: int, timeout_s: float,
               on_done: Callable[[Outcome], None] | None) -> list[Outcome]:
    local = threading.local()
    clients: list[httpx.Client] = []
    lock = threading.Lock()

    def client() -> httpx.Client:
        if not hasattr(local, "client"):
            local.client = httpx.Client(base_url=url, timeout=timeout_s)
            with lock:
                clients.append(local.client)
        return local.client  # type: ignore[no-any-return]

    def one(request: SoakRequest) -> Outcome:
        outcome = send(client(), phase, request)
        if on_done is not None:
            on_done(outcome)
        return outcome

    try:
        with ThreadPoolExecutor(concurrency, thread_name_prefix=f"soak-{phase}") as pool:
            return list(pool.map(one, requests))
    finally:
        for c in clients:
            c.close()


def send(client: httpx.Client, phase: str, request: SoakRequest) -> Outcome:
    started = time.perf_counter()
    try:
        if request.kind == "disconnect":
            label = _disconnect(client, request)
            return Outcome(request.kind, phase, label, time.perf_counter() - started)
        if request.kind == "cancel":
            try:
                response = client.post("/v1/chat/completions", json=request.body, timeout=CANCEL_AFTER_S)
            except httpx.TimeoutException:
                return Outcome(request.kind, phase, "cancelled", time.perf_counter() - started)
            label = "5xx" if response.status_code >= 500 else str(response.status_code)
            return Outcome(request.kind, phase, label, time.perf_counter() - started)
        result = exchange(client, "POST", "/v1/chat/completions", _encode(request.body),
                          {"content-type": "application/json"}, request.body)
    except httpx.HTTPError as exc:
        return Outcome(request.kind, phase, "lost", time.perf_counter() - started, f"{type(exc).__name__}: {exc}")
    elapsed = time.perf_counter() - started
    if not result.problems:
        return Outcome(request.kind, phase, str(result.status), elapsed)
    problem = result.problems[0]
    if problem.startswith(("server error", "engine error")):
        label = "5xx"
    else:
        label = "fail_open" if "choices[" in problem else "bad_shape"
    return Outcome(request.kind, phase, label, elapsed, problem[:300])


def _disconnect(client: httpx.Client, request: SoakRequest) -> str:
    with client.stream("POST", "/v1/chat/completions", json=request.body) as response:
        if response.status_code >= 500:
            return "5xx"
        if response.status_code != 200:
            return str(response.status_code)
        for line in response.iter_lines():
            if line.startswith("data:"):
                return "disconnected"  # leaving the block closes the connection mid-stream
    return "200"  # the whole answer came before the first data line was read


def _encode(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def _restarts(url: str) -> float | None:
    try:
        text = httpx.get(f"{url}/metrics", timeout=30).text
    except httpx.HTTPError:
        return None
    for name in RESTART_METRICS:
        match = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.MULTILINE)
        if match:
            return float(match.group(1))
    return 0.0 if "corral_watchdog_trips_total" in text else None


def _healthy(url: str, max_tokens: int) -> bool:
    try:
        health = httpx.get(f"{url}/health", timeout=30)
        answer = httpx.post(f"{url}/v1/chat/completions", json=ordinary(1, max_tokens).body, timeout=120)
    except httpx.HTTPError:
        return False
    return health.status_code == 200 and answer.status_code == 200
