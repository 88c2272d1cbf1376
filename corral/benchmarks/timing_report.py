"""What the micro-benchmarks (`bench sampler`, `bench projection`, `bench prefix`, `bench engine`) share: the
calling thread's CPU time per call, the speed-up column, and their report: results.json and a bar chart of
corral against its reference, one pair of bars per row."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from corral.benchmarks.harness import Bench, pyplot, save_figure


def cpu_ms(fn: Callable[[], object], repeats: int) -> float:
    """The calling thread's CPU milliseconds per call of `fn` over `repeats` calls (steadier than wall time
    on a shared machine)."""
    start = time.thread_time()
    for _ in range(repeats):
        fn()
    return (time.thread_time() - start) / repeats * 1000


def speedup_of(reference_ms: float, corral_ms: float) -> float:
    return reference_ms / corral_ms if corral_ms > 0 else float("inf")


def report_pairs(
    bench: Bench, config: dict[str, Any], rows: Sequence[dict[str, Any]], labels: Sequence[str],
    reference: Sequence[float], corral: Sequence[float], *, reference_label: str, corral_label: str, xlabel: str,
) -> int:
    """OUT/results.json, OUT/<command>.png (plot_pairs) and the line that names them; 0, the exit status."""
    results = bench.write_results(config, rows)
    plot_pairs(bench.plot_path, labels, reference, corral, reference_label=reference_label,
               corral_label=corral_label, xlabel=xlabel)
    bench.wrote(results, bench.plot_path)
    return 0


def plot_pairs(
    path: Path, labels: Sequence[str], reference: Sequence[float], corral: Sequence[float], *,
    reference_label: str, corral_label: str, xlabel: str,
) -> None:
    """Horizontal bars on a log axis: the reference hatched above corral, row by row."""
    fig, ax = pyplot().subplots(figsize=(10, 0.45 * len(labels) + 1.5))
    y = range(len(labels))
    ax.barh([i + 0.2 for i in y], list(reference), height=0.4, label=reference_label, hatch="//")
    ax.barh([i - 0.2 for i in y], list(corral), height=0.4, label=corral_label)
    ax.set_yticks(list(y), list(labels), fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.legend()
    save_figure(fig, path, dpi=110)
