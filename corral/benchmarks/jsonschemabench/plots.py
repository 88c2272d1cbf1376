"""PNG plots with matplotlib's Agg backend (no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from corral.benchmarks.harness import pyplot, save_figure
from corral.benchmarks.jsonschemabench.latency import LatencyHistogram
from corral.benchmarks.jsonschemabench.report import ALL


def coverage_bars(rows: list[dict[str, Any]], path: Path, metrics: list[tuple[str, str]]) -> Path:
    """Grouped bars: one group per subset, one bar per backend × metric (e.g. declared, empirical)."""
    subsets = list(dict.fromkeys(r["subset"] for r in rows if r["subset"] != ALL))
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    series = [(b, key, label) for key, label in metrics for b in backends]
    width = 0.8 / max(1, len(series))
    fig, ax = pyplot().subplots(figsize=(max(6, 1.6 * len(subsets)), 4))
    for i, (backend, key, label) in enumerate(series):
        values = []
        for subset in subsets:
            row = next((r for r in rows if r["subset"] == subset and r["backend"] == backend), None)
            values.append((row or {}).get(key) or 0.0)
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(subsets))]
        ax.bar(xs, values, width, label=f"{backend} {label}" if len(metrics) > 1 else backend)
    ax.set_xticks(range(len(subsets)), subsets, rotation=20, ha="right")
    ax.set_ylabel("% of schemas")
    ax.set_ylim(0, 105)
    ax.set_title("Coverage per subset")
    ax.legend(fontsize="small", loc="lower left")
    return save_figure(fig, path)


def mask_latency_cdf(records: list[dict[str, Any]], backends: list[str], path: Path) -> Path:
    """CDF of per-token mask fill time per backend, over every teacher-forced valid instance."""
    fig, ax = pyplot().subplots(figsize=(6, 4))
    for backend in backends:
        hist = LatencyHistogram()
        for r in records:
            if r["backend"] == backend and r.get("tbm"):
                hist.merge(LatencyHistogram.from_json(r["tbm"]))
        if hist.count:
            xs, ys = hist.cdf()
            ax.step(xs, ys, where="post", label=f"{backend} (n={hist.count:,})")
    ax.set_xscale("log")
    ax.set_xlabel("mask fill time per token (µs)")
    ax.set_ylabel("fraction of tokens")
    ax.set_ylim(0, 1.01)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title("Mask latency CDF (teacher-forced valid instances)")
    ax.legend(fontsize="small", loc="lower right")
    return save_figure(fig, path)
