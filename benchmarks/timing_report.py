"""What the micro-benchmarks (`bench sampler`, `bench projection`, `bench prefix`, `bench engine`) share: the
calling thread's CPU time per call, the speed-up column, results.json and a bar chart of corral against its
reference, one pair of bars per row."""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def cpu_ms(fn: Callable[[], object], repeats: int) -> float:
    """The calling thread's CPU milliseconds per call of `fn` over `repeats` calls (steadier than wall time
    on a shared machine)."""
    start = time.thread_time()
    for _ in range(repeats):
        fn()
    return (time.thread_time() - start) / repeats * 1000


def speedup_of(reference_ms: float, corral_ms: float) -> float:
    return reference_ms / corral_ms if corral_ms > 0 else float("inf")


def write_results(out: Path, config: dict[str, Any], rows: Sequence[dict[str, Any]]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    path.write_text(json.dumps({
        "config": config,
        "machine": {"processor": platform.processor() or platform.machine(), "python": platform.python_version()},
        "results": list(rows),
    }, indent=2))
    return path


def plot_pairs(
    path: Path, labels: Sequence[str], reference: Sequence[float], corral: Sequence[float], *,
    reference_label: str, corral_label: str, xlabel: str,
) -> None:
    """Horizontal bars on a log axis: the reference hatched above corral, row by row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 0.45 * len(labels) + 1.5))
    y = range(len(labels))
    ax.barh([i + 0.2 for i in y], list(reference), height=0.4, label=reference_label, hatch="//")
    ax.barh([i - 0.2 for i in y], list(corral), height=0.4, label=corral_label)
    ax.set_yticks(list(y), list(labels), fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
