"""Schemathesis over corral's own OpenAPI document: every operation, positive and negative cases, each
request sent over one kept-alive httpx connection and judged by the oracle (corral/benchmarks/fuzz/oracle.py)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from corral.benchmarks.fuzz.probe import exchange

log = logging.getLogger(__name__)

# Generated requests keep their hostile values, but not their length: max_tokens above this is lowered, so a
# run's cost is the number of requests, not the size of the numbers hypothesis likes to draw.
MAX_TOKENS_CAP = 16
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens")
ORDINARY = {"model": "corral-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16,
            "structured_outputs": {"choice": ["fine", "good"]}}


@dataclass
class FuzzReport:
    requests: int = 0
    distinct: set[str] = field(default_factory=set)
    statuses: Counter[str] = field(default_factory=Counter)  # 2xx, 4xx, 5xx, lost
    per_operation: dict[str, Counter[str]] = field(default_factory=dict)
    server_errors: list[dict[str, Any]] = field(default_factory=list)
    fail_open: list[dict[str, Any]] = field(default_factory=list)
    bad_shape: list[dict[str, Any]] = field(default_factory=list)
    lost: list[dict[str, Any]] = field(default_factory=list)
    healthy_after: bool = False
    wall_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "requests": self.requests, "distinct_cases": len(self.distinct), "statuses": dict(self.statuses),
            "5xx": len(self.server_errors), "fail_open": len(self.fail_open), "bad_error_shape": len(self.bad_shape),
            "lost": len(self.lost), "healthy_after": self.healthy_after, "wall_s": round(self.wall_s, 1),
        }

    def as_json(self) -> dict[str, Any]:
        return {"summary": self.summary(),
                "per_operation": {op: dict(counts) for op, counts in self.per_operation.items()},
                "server_errors": self.server_errors, "fail_open": self.fail_open, "bad_error_shape": self.bad_shape,
                "lost": self.lost}


def tame(body: Any) -> Any:
    """The body with a positive max_tokens above MAX_TOKENS_CAP lowered to it (everything else as drawn)."""
    if not isinstance(body, dict):
        return body
    tamed = dict(body)
    for name in TOKEN_FIELDS:
        value = tamed.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_TOKENS_CAP:
            tamed[name] = MAX_TOKENS_CAP
    return tamed


def run_fuzz(base_url: str, requests: int, *, seed: int | None = None, timeout_s: float = 120.0,
             on_request: Callable[[str, int], None] | None = None) -> FuzzReport:
    """About `requests` generated requests spread over the operations (those without parameters get a
    couple each; hypothesis stops an operation early once it has nothing new to draw). `seed` None:
    derandomized, the same cases every run."""
    import schemathesis
    from schemathesis.core.result import Ok
    from schemathesis.generation.modes import GenerationMode

    base_url = base_url.rstrip("/")
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    operations = []
    for result in schema.get_all_operations():
        if not isinstance(result, Ok):
            raise RuntimeError(f"{base_url}/openapi.json: an operation schemathesis cannot read: {result.err()}")
        operations.append(result.ok())
    with_body = [op for op in operations if op.body]
    per_run = max(1, math.ceil(requests / max(1, 2 * len(with_body))))
    report = FuzzReport()
    started = time.perf_counter()
    with httpx.Client(base_url=base_url, timeout=timeout_s,
                      limits=httpx.Limits(max_connections=1, max_keepalive_connections=1)) as client:
        for op in operations:
            label = f"{op.method.upper()} {op.path}"
            counts = report.per_operation.setdefault(label, Counter())
            send = _sender(client, base_url, label, counts, report, on_request)
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                _drive(op.as_strategy(generation_mode=mode), send, per_run if op.body else 2, seed)
        report.healthy_after = _healthy(client)
    report.wall_s = time.perf_counter() - started
    return report


def _sender(client: httpx.Client, base_url: str, label: str, counts: Counter[str], report: FuzzReport,
            on_request: Callable[[str, int], None] | None) -> Callable[[Any], None]:
    def send(case: Any) -> None:
        _send_case(client, base_url, case, label, counts, report)
        if on_request is not None:
            on_request(label, report.requests)

    return send


def _drive(strategy: Any, send: Callable[[Any], None], examples: int, seed: int | None) -> None:
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as with_seed
    from hypothesis.errors import Unsatisfiable

    # Failures are recorded, never raised, so hypothesis neither shrinks nor stops: it only draws cases.
    test: Callable[[], None] = settings(
        max_examples=examples, derandomize=seed is None, database=None, deadline=None,
        phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck),
    )(given(strategy)(send))  # type: ignore[no-untyped-call]
    if seed is not None:
        test = with_seed(seed)(test)
    with contextlib.suppress(Unsatisfiable):  # no case of this mode exists (negative, without parameters)
        test()


def _send_case(client: httpx.Client, base_url: str, case: Any, label: str, counts: Counter[str],
               report: FuzzReport) -> None:
    wire = case.as_transport_kwargs(base_url=base_url)
    body = tame(wire.get("json"))
    if "json" in wire:
        content: bytes | None = json.dumps(body, allow_nan=True).encode()
    else:
        data = wire.get("data")
        content = data.encode() if isinstance(data, str) else data if isinstance(data, bytes) else None
    headers = {str(k): str(v) for k, v in (wire.get("headers") or {}).items()}
    path = str(wire["url"])[len(base_url):] or "/"
    key = hashlib.sha256(repr((label, wire.get("params"), content)).encode()).hexdigest()
    report.requests += 1
    report.distinct.add(key)
    record = {"operation": label, "body": (content or b"")[:2000].decode("utf-8", "replace")}
    try:
        result = exchange(client, str(wire["method"]), path, content, headers, body)
    except httpx.HTTPError as exc:
        counts["lost"] += 1
        report.statuses["lost"] += 1
        report.lost.append({**record, "error": f"{type(exc).__name__}: {exc}"})
        return
    status_class = f"{result.status // 100}xx"
    counts[status_class] += 1
    report.statuses[status_class] += 1
    for problem in result.problems:
        target = (report.server_errors if problem.startswith(("server error", "engine error"))
                  else report.fail_open if "choices[" in problem else report.bad_shape)
        target.append({**record, "status": result.status, "problem": problem})


def _healthy(client: httpx.Client) -> bool:
    try:
        health = client.get("/health")
        answer = client.post("/v1/chat/completions", json=ORDINARY)
    except httpx.HTTPError:
        return False
    return health.status_code == 200 and answer.status_code == 200 and \
        answer.json()["choices"][0]["message"]["content"] in ("fine", "good")
