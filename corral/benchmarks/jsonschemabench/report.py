"""Aggregate per-schema records into per subset × backend rows: the markdown/rich table and results.json."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from corral.benchmarks.jsonschemabench.latency import LatencyHistogram, percentile

ALL = "ALL"


@dataclass(frozen=True)
class Table:
    headers: list[str]
    rows: list[list[str]]

    def markdown(self) -> str:
        lines = ["| " + " | ".join(self.headers) + " |", "|" + "|".join("---" for _ in self.headers) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        return "\n".join(lines)


def _pct(part: int, whole: int) -> float | None:
    return round(100 * part / whole, 1) if whole else None


def _p50(values: Iterable[float | None]) -> float | None:
    present = sorted(v for v in values if v is not None)
    return round(percentile(present, 0.5), 3) if present else None


Group = tuple[str, str, list[dict[str, Any]]]


def _groups(records: list[dict[str, Any]], subsets: list[str], backends: list[str]) -> list[Group]:
    out = []
    for subset in [*subsets, ALL]:
        for backend in backends:
            chosen = [r for r in records if r["backend"] == backend and (subset == ALL or r["subset"] == subset)]
            if chosen:
                out.append((subset, backend, chosen))
    return out


def summarize_masks(records: list[dict[str, Any]], subsets: list[str], backends: list[str]) -> list[dict[str, Any]]:
    rows = []
    for subset, backend, group in _groups(records, subsets, backends):
        declared = [r for r in group if r["status"] == "ok"]
        hist = LatencyHistogram()
        for r in declared:
            if r.get("tbm"):
                hist.merge(LatencyHistogram.from_json(r["tbm"]))
        rows.append({
            "subset": subset, "backend": backend, "schemas": len(group),
            "declared": len(declared), "declared_pct": _pct(len(declared), len(group)),
            "timeouts": sum(r["status"] == "timeout" for r in group),
            "errors": sum(r["status"] == "error" for r in group),
            "meta_invalid": sum(not r.get("meta_valid", True) for r in group),
            "gct_p50_ms": _p50(r.get("gct_ms") for r in declared),
            "valid_instances": sum(r["valid_total"] for r in declared),
            "sound_failures": sum(len(r["sound_failures"]) for r in declared),
            "invalid_instances": sum(r["invalid_total"] for r in declared),
            "strict_failures": sum(len(r["strict_failures"]) for r in declared),
            "mask_mismatch": sum(r.get("mask_mismatch", 0) for r in declared),
            "tbm_tokens": hist.count,
            "tbm_mean_us": _round(hist.mean_us), "tbm_p50_us": _round(hist.quantile(0.5)),
            "tbm_p99_us": _round(hist.quantile(0.99)), "tbm_max_us": _round(hist.max_us if hist.count else math.nan),
            "strict_failures_by_keyword": dict(Counter(f["keyword"] for r in declared for f in r["strict_failures"])
                                               .most_common()),
        })
    return rows


def summarize_generate(records: list[dict[str, Any]], subsets: list[str], backends: list[str]) -> list[dict[str, Any]]:
    rows = []
    for subset, backend, group in _groups(records, subsets, backends):
        declared = [r for r in group if r["status"] not in ("rejected", "timeout", "error")]
        valid = sum(bool(r.get("valid")) for r in declared)
        finished = [r for r in declared if r.get("finish_reason") == "stop"]
        rows.append({
            "subset": subset, "backend": backend, "schemas": len(group),
            "declared": len(declared), "declared_pct": _pct(len(declared), len(group)),
            "compile_timeouts": sum(r["status"] == "timeout" for r in group),
            "errors": sum(r["status"] == "error" for r in group),
            "valid": valid,
            "empirical_pct": _pct(valid, len(group)),
            "compliance_pct": _pct(valid, len(declared)),
            "finished": len(finished),
            "finished_compliance_pct": _pct(sum(bool(r.get("valid")) for r in finished), len(finished)),
            "length": sum(r.get("finish_reason") == "length" for r in declared),
            "gen_timeouts": sum(r["status"] == "gen_timeout" for r in group),
            "gct_p50_ms": _p50(r.get("gct_ms") for r in declared),
            "ttft_p50_ms": _p50(r.get("ttft_ms") for r in declared),
            "tpot_p50_ms": _p50(r.get("tpot_ms") for r in declared),
            "finish_reasons": dict(Counter(str(r.get("finish_reason")) for r in declared).most_common()),
        })
    return rows


def _round(value: float) -> float | None:
    return None if math.isnan(value) else round(value, 1)


def _fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.1f}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def masks_table(rows: list[dict[str, Any]]) -> Table:
    headers = ["subset", "backend", "schemas", "declared %", "timeouts", "GCT p50 ms", "valid inst",
               "sound fail", "invalid inst", "strict fail", "mask≠accept", "TBM mean µs", "TBM p50 µs",
               "TBM p99 µs", "TBM max µs"]
    keys = ["subset", "backend", "schemas", "declared_pct", "timeouts", "gct_p50_ms", "valid_instances",
            "sound_failures", "invalid_instances", "strict_failures", "mask_mismatch", "tbm_mean_us", "tbm_p50_us",
            "tbm_p99_us", "tbm_max_us"]
    return Table(headers, [[_fmt(row[k]) for k in keys] for row in rows])


def keyword_table(rows: list[dict[str, Any]]) -> Table:
    """Strictness failures per keyword, over all subsets, one column per backend."""
    totals = {row["backend"]: row["strict_failures_by_keyword"] for row in rows if row["subset"] == ALL}
    keywords = sorted({k for counts in totals.values() for k in counts},
                      key=lambda k: -sum(c.get(k, 0) for c in totals.values()))
    backends = list(totals)
    return Table(["keyword", *backends], [[k, *(str(totals[b].get(k, 0)) for b in backends)] for k in keywords])


def finish_table(rows: list[dict[str, Any]]) -> Table:
    """How declared answers ended, over all subsets, one column per backend (watchdog trips included:
    `dead_end` is where `auto`'s contract guard refused an ending the full schema rejects)."""
    totals = {row["backend"]: row["finish_reasons"] for row in rows if row["subset"] == ALL}
    reasons = sorted({k for counts in totals.values() for k in counts},
                     key=lambda k: (-sum(c.get(k, 0) for c in totals.values()), k))
    backends = list(totals)
    return Table(["finish_reason", *backends], [[k, *(str(totals[b].get(k, 0)) for b in backends)] for k in reasons])


def generate_table(rows: list[dict[str, Any]]) -> Table:
    headers = ["subset", "backend", "schemas", "declared %", "compile timeouts", "empirical %", "compliance %",
               "finished compliance %", "length", "gen timeouts", "GCT p50 ms", "TTFT p50 ms", "TPOT p50 ms"]
    keys = ["subset", "backend", "schemas", "declared_pct", "compile_timeouts", "empirical_pct", "compliance_pct",
            "finished_compliance_pct", "length", "gen_timeouts", "gct_p50_ms", "ttft_p50_ms", "tpot_p50_ms"]
    return Table(headers, [[_fmt(row[k]) for k in keys] for row in rows])
