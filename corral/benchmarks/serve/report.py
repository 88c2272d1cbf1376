"""results.json, the PNG, and the rows of the printed table."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from corral.benchmarks.harness import pyplot, save_figure

# (key in a run's metrics, column header, format)
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("mode", "mode", "{}"),
    ("concurrency", "conc", "{}"),
    ("ok", "ok", "{}"),
    ("completion_tokens", "tokens", "{}"),
    ("wall_s", "wall s", "{:.2f}"),
    ("throughput_tok_s", "tok/s", "{:.1f}"),
    ("requests_per_s", "req/s", "{:.2f}"),
    ("ttft_ms_p50", "TTFT p50 ms", "{:.1f}"),
    ("ttft_ms_p99", "TTFT p99 ms", "{:.1f}"),
    ("tpot_ms_p50", "TPOT p50 ms", "{:.2f}"),
    ("tpot_ms_p99", "TPOT p99 ms", "{:.2f}"),
    ("mask_us_p50", "mask p50 µs", "{:.1f}"),
    ("forward_ms_mean", "fwd ms", "{:.2f}"),
    ("tokens_per_step", "tok/step", "{:.2f}"),
    ("forced_share", "forced", "{:.0%}"),
    ("compliance", "compliance", "{:.0%}"),
    ("finish_reasons", "finish", "{}"),
)


def cell(value: Any, fmt: str) -> str:
    if value is None:
        return "–"
    if isinstance(value, dict):
        return " ".join(f"{k}:{v}" for k, v in sorted(value.items()))
    return fmt.format(value)


PEER_PREFIX = "peer "  # a peer's rows read "peer constrained", "peer unconstrained"


def _labelled(runs: Sequence[dict[str, Any]], peer_runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """corral's and the peer's runs in one list, each peer row right under corral's row of the same level and
    mode, with its mode prefixed."""
    rows: list[dict[str, Any]] = []
    for run in runs:
        rows.append(run)
        rows += [{**p, "mode": PEER_PREFIX + p["mode"]} for p in peer_runs
                 if (p["mode"], p["concurrency"]) == (run["mode"], run["concurrency"])]
    return rows


def table_rows(runs: Sequence[dict[str, Any]], baseline: dict[str, Any] | None,
               peer_runs: Sequence[dict[str, Any]] = ()) -> list[list[str]]:
    rows = [[cell(run.get(key), fmt) for key, _, fmt in COLUMNS] for run in _labelled(runs, peer_runs)]
    if baseline is not None:
        rows.append([cell(baseline.get(key), fmt) for key, _, fmt in COLUMNS])
    return rows


def markdown_table(runs: Sequence[dict[str, Any]], baseline: dict[str, Any] | None,
                   peer_runs: Sequence[dict[str, Any]] = ()) -> str:
    header = [h for _, h, _ in COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(runs, baseline, peer_runs)]
    return "\n".join(lines)


def ratio_lines(ratios: dict[str, dict[str, Any]]) -> list[str]:
    out = []
    for name, r in ratios.items():
        value = "n/a" if r["value"] is None else (
            f"{r['value']:.1%}" if name.endswith("compliance") else f"{r['value']:.2f}")
        verdict = {True: "met", False: "MISSED", None: "n/a"}[r["met"]]
        judged = "no target" if r["target"] == "–" else f"target {r['target']}, {verdict}"
        out.append(f"{name}: {value} ({judged}) = {r['numerator_from']} "
                   f"{_num(r['numerator'])} ÷ {r['denominator_from']} {_num(r['denominator'])}")
    return out


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"


def throughput_plot(runs: Sequence[dict[str, Any]], baseline: dict[str, Any] | None, path: Path,
                    peer_runs: Sequence[dict[str, Any]] = ()) -> Path:
    """Grouped bars: output tok/s per concurrency, one bar per mode (and per peer mode, hatched); the baseline
    as a horizontal line."""
    runs = _labelled(runs, peer_runs)
    levels = sorted({int(r["concurrency"]) for r in runs})
    modes = list(dict.fromkeys(r["mode"] for r in runs))
    width = 0.8 / max(1, len(modes))
    fig, ax = pyplot().subplots(figsize=(7, 4))
    # A peer's bars take the colour of corral's bars of the same mode, hatched.
    colours = {m: f"C{k}" for k, m in enumerate(dict.fromkeys(m.removeprefix(PEER_PREFIX) for m in modes))}
    for i, mode in enumerate(modes):
        values = []
        for level in levels:
            run = next((r for r in runs if r["mode"] == mode and r["concurrency"] == level), None)
            values.append((run or {}).get("throughput_tok_s") or 0.0)
        xs = [j + (i - (len(modes) - 1) / 2) * width for j in range(len(levels))]
        bars = ax.bar(xs, values, width, label=mode, color=colours[mode.removeprefix(PEER_PREFIX)],
                      hatch="//" if mode.startswith(PEER_PREFIX) else None)
        ax.bar_label(bars, fmt="%.0f", fontsize="small")
    if baseline is not None and baseline.get("throughput_tok_s"):
        ax.axhline(baseline["throughput_tok_s"], color="black", linestyle="--",
                   label=f"naive baseline (HF generate + xgrammar), {baseline['throughput_tok_s']:.0f} tok/s")
    ax.set_xticks(range(len(levels)), [str(level) for level in levels])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens / s")
    ax.set_title("corral serving throughput" + (" vs the peer" if peer_runs else ""))
    ax.legend(fontsize="small", loc="upper left")
    return save_figure(fig, path)
