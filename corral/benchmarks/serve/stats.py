"""Pure arithmetic of the serving benchmark: percentiles, per-run metrics and the headline ratios."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any


def percentile(values: Iterable[float | None], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's default);
    None entries are ignored, and no values gives None."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be within 0..100, got {q}")
    data = sorted(v for v in values if v is not None)
    if not data:
        return None
    pos = (len(data) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def mean(values: Iterable[float | None]) -> float | None:
    data = [v for v in values if v is not None]
    return sum(data) / len(data) if data else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


@dataclass(frozen=True)
class RequestResult:
    """One request as the benchmark saw it. `timings` is the server's own `timings` extra."""

    mode: str  # constrained | unconstrained
    concurrency: int
    case_id: str
    status: str  # ok | refused (HTTP 400) | error
    http_status: int | None = None
    finish_reason: str | None = None
    completion_tokens: int = 0
    client_ms: float | None = None
    timings: dict[str, Any] = field(default_factory=dict)
    backend: str | None = None
    valid: bool | None = None  # constrained answers that finished: judged here against the full schema
    error: str | None = None
    text: str = ""
    server: str = "corral"  # or "peer"

    def timing(self, key: str) -> float | None:
        value = self.timings.get(key)
        return float(value) if isinstance(value, (int, float)) else None


def summarize_run(mode: str, concurrency: int, results: Sequence[RequestResult], wall_s: float) -> dict[str, Any]:
    """Metrics of one (mode, concurrency) run. Latencies are the server's per-request `timings`; the mask
    figure is the median of the per-request medians (the server reports no raw samples)."""
    ok = [r for r in results if r.status == "ok"]
    tokens = sum(r.completion_tokens for r in ok)
    forced = sum(int(r.timing("forced_tokens") or 0) for r in ok)
    steps = sum(int(r.timing("forward_steps") or 0) for r in ok)
    finished = [r for r in ok if r.finish_reason == "stop"]
    valid = sum(1 for r in finished if r.valid)
    constrained = mode == "constrained"
    reported = any("forced_tokens" in r.timings for r in ok)  # a peer reports no `timings`
    return {
        "mode": mode,
        "concurrency": concurrency,
        "requests": len(results),
        "ok": len(ok),
        "errors": len(results) - len(ok),
        "completion_tokens": tokens,
        "wall_s": wall_s,
        "throughput_tok_s": tokens / wall_s if wall_s > 0 else None,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
        "ttft_ms_p50": percentile((r.timing("ttft_ms") for r in ok), 50),
        "ttft_ms_p99": percentile((r.timing("ttft_ms") for r in ok), 99),
        "tpot_ms_p50": percentile((r.timing("tpot_ms") for r in ok), 50),
        "tpot_ms_p99": percentile((r.timing("tpot_ms") for r in ok), 99),
        "queue_ms_p50": percentile((r.timing("queue_ms") for r in ok), 50),
        "compile_ms_mean": mean(r.timing("compile_ms") for r in ok),
        "latency_ms_p50": percentile((r.client_ms for r in ok), 50),
        "mask_us_p50": percentile((r.timing("mask_us_p50") for r in ok), 50),
        "mask_us_p99": percentile((r.timing("mask_us_p99") for r in ok), 99),
        "forward_ms_mean": mean(r.timing("forward_ms_mean") for r in ok),
        "forward_steps": steps,
        "tokens_per_step": tokens / steps if steps else None,
        "forced_tokens": forced,
        "forced_share": forced / tokens if tokens and reported else None,
        "finish_reasons": dict(Counter(str(r.finish_reason) for r in ok)),
        "finished": len(finished) if constrained else None,
        "valid": valid if constrained else None,
        "compliance": (valid / len(finished) if finished else None) if constrained else None,
    }


@dataclass(frozen=True)
class Target:
    name: str
    description: str
    op: str  # "<=" or ">="; "" for a ratio reported without a target
    target: float | None


TARGETS = (
    Target("tpot_constrained_over_unconstrained", "constrained TPOT ÷ unconstrained TPOT (p50) at the lowest "
           "concurrency", "<=", 1.0),
    Target("throughput_scaling", "constrained throughput at the highest ÷ at the lowest concurrency", ">=", 4.0),
    Target("unconstrained_scaling", "unconstrained throughput at the highest ÷ at the lowest concurrency",
           ">=", 3.5),
    Target("corral_over_baseline", "corral constrained throughput at the highest concurrency ÷ naive baseline "
           "throughput", ">=", 3.0),
    Target("compliance", "finished constrained answers that validate against the full schema", ">=", 1.0),
)

PEER_TARGETS = (
    Target("unconstrained_corral_over_peer", "corral ÷ peer unconstrained throughput at the highest concurrency",
           ">=", 1.0),
    Target("constrained_corral_over_peer", "corral ÷ peer constrained throughput at the highest concurrency",
           ">=", 3.0),
    Target("peer_throughput_scaling", "peer constrained throughput at the highest ÷ at the lowest concurrency",
           "", None),
    Target("peer_unconstrained_scaling", "peer unconstrained throughput at the highest ÷ at the lowest "
           "concurrency", "", None),
    Target("peer_compliance", "the peer's finished constrained answers that validate against the full schema",
           "", None),
)


def find_run(runs: Sequence[dict[str, Any]], mode: str, concurrency: int) -> dict[str, Any] | None:
    return next((r for r in runs if r["mode"] == mode and r["concurrency"] == concurrency), None)


def _get(run: dict[str, Any] | None, key: str) -> float | None:
    value = run.get(key) if run else None
    return float(value) if isinstance(value, (int, float)) else None


def _levels(runs: Sequence[dict[str, Any]]) -> tuple[int, int] | None:
    levels = sorted({int(r["concurrency"]) for r in runs})
    return (levels[0], levels[-1]) if levels else None


def _compliance_counts(runs: Sequence[dict[str, Any]]) -> tuple[float, float]:
    constrained = [r for r in runs if r["mode"] == "constrained"]
    return (float(sum(int(r["finished"] or 0) for r in constrained)),
            float(sum(int(r["valid"] or 0) for r in constrained)))


Inputs = dict[str, tuple[float | None, float | None, str, str]]


def _judge(targets: Sequence[Target], inputs: Inputs) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for t in targets:
        num, den, num_src, den_src = inputs[t.name]
        value = ratio(num, den)
        met = None if value is None or t.target is None else (
            value <= t.target if t.op == "<=" else value >= t.target)
        out[t.name] = {
            "value": value, "target": "–" if t.target is None else f"{t.op} {t.target:g}", "met": met,
            "description": t.description, "numerator": num, "denominator": den,
            "numerator_from": num_src, "denominator_from": den_src,
        }
    return out


def _scaling(runs: Sequence[dict[str, Any]], mode: str, low: int, high: int, who: str
             ) -> tuple[float | None, float | None, str, str]:
    return (_get(find_run(runs, mode, high), "throughput_tok_s"), _get(find_run(runs, mode, low), "throughput_tok_s"),
            f"{who}{mode}@{high}.throughput_tok_s", f"{who}{mode}@{low}.throughput_tok_s")


def headline_ratios(runs: Sequence[dict[str, Any]], baseline: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """The issue's numbers, each with the inputs it was computed from (so a reader can recompute it)."""
    span = _levels(runs)
    if span is None:
        return {}
    low, high = span
    finished, valid = _compliance_counts(runs)
    inputs: Inputs = {
        "tpot_constrained_over_unconstrained": (
            _get(find_run(runs, "constrained", low), "tpot_ms_p50"),
            _get(find_run(runs, "unconstrained", low), "tpot_ms_p50"),
            f"constrained@{low}.tpot_ms_p50", f"unconstrained@{low}.tpot_ms_p50"),
        "throughput_scaling": _scaling(runs, "constrained", low, high, ""),
        "unconstrained_scaling": _scaling(runs, "unconstrained", low, high, ""),
        "corral_over_baseline": (
            _get(find_run(runs, "constrained", high), "throughput_tok_s"), _get(baseline, "throughput_tok_s"),
            f"constrained@{high}.throughput_tok_s", "baseline.throughput_tok_s"),
        "compliance": (valid, finished, "valid (all constrained runs)", "finished with stop (all constrained runs)"),
    }
    return _judge(TARGETS, inputs)


def peer_ratios(runs: Sequence[dict[str, Any]], peer_runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """corral against the peer at the highest concurrency both ran, and the peer's own scaling and compliance."""
    span = _levels([*runs, *peer_runs])
    if span is None:
        return {}
    low, high = span
    finished, valid = _compliance_counts(peer_runs)

    def versus(mode: str) -> tuple[float | None, float | None, str, str]:
        return (_get(find_run(runs, mode, high), "throughput_tok_s"),
                _get(find_run(peer_runs, mode, high), "throughput_tok_s"),
                f"{mode}@{high}.throughput_tok_s", f"peer.{mode}@{high}.throughput_tok_s")

    inputs: Inputs = {
        "unconstrained_corral_over_peer": versus("unconstrained"),
        "constrained_corral_over_peer": versus("constrained"),
        "peer_throughput_scaling": _scaling(peer_runs, "constrained", low, high, "peer."),
        "peer_unconstrained_scaling": _scaling(peer_runs, "unconstrained", low, high, "peer."),
        "peer_compliance": (valid, finished, "peer valid (all constrained runs)",
                            "peer finished with stop (all constrained runs)"),
    }
    return _judge(PEER_TARGETS, inputs)
