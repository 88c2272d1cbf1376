"""results.json, the per-subset breakdown, the PNG and the printed tables of `corral bench tools`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from corral.benchmarks.harness import pyplot, save_figure
from corral.benchmarks.jsonschemabench.dataset import SchemaCase
from corral.benchmarks.tools.judge import ToolResult

# Per subset, every tried schema lands in exactly one of these (the PNG's stacked bars).
OUTCOMES = ("all calls valid", "an invalid call", "no call", "refused (400)", "error")

SUMMARY_ROWS: tuple[tuple[str, str], ...] = (
    ("tried", "schemas tried"),
    ("refused", "refused (400)"),
    ("errors", "other errors"),
    ("answered", "answered (200)"),
    ("with_tool_calls", "answers with tool_calls"),
    ("without_tool_calls", "answers without tool_calls"),
    ("calls", "tool calls returned"),
    ("calls_valid", "calls whose arguments validate"),
    ("calls_invalid", "calls that do not validate"),
    ("wrong_name", "calls naming another function"),
    ("finish_mismatch", "finish_reason ≠ tool_calls with calls (or = without)"),
)


def outcome(result: ToolResult) -> str:
    if result.status == "refused":
        return "refused (400)"
    if result.status != "ok":
        return "error"
    if not result.calls:
        return "no call"
    return "all calls valid" if all(c.valid for c in result.calls) else "an invalid call"


def per_subset(cases: Sequence[SchemaCase], results: Sequence[ToolResult]) -> dict[str, dict[str, int]]:
    """Outcome counts per subset (subsets in the order the cases came)."""
    subset_of = {c.case_id: c.subset for c in cases}
    out: dict[str, dict[str, int]] = {}
    for r in results:
        counts = out.setdefault(subset_of.get(r.case_id, "?"), dict.fromkeys(OUTCOMES, 0))
        counts[outcome(r)] += 1
    return out


def summary_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [(label, str(summary[key])) for key, label in SUMMARY_ROWS]
    compliance, call_rate = summary.get("compliance"), summary.get("call_rate")
    rows.append(("compliance (valid ÷ returned calls)",
                 "n/a" if compliance is None else f"{compliance:.1%} ({summary['calls_valid']}/{summary['calls']})"))
    rows.append(("answers with a call ÷ answered", "n/a" if call_rate is None else f"{call_rate:.1%}"))
    rows.append(("finish reasons", " ".join(f"{k}:{v}" for k, v in sorted(summary["finish_reasons"].items()))))
    return rows


def outcome_plot(counts: dict[str, dict[str, int]], path: Path) -> Path:
    subsets = list(counts)
    fig, ax = pyplot().subplots(figsize=(8, 4))
    bottom = [0] * len(subsets)
    for name in OUTCOMES:
        values = [counts[s][name] for s in subsets]
        if any(values):
            ax.bar(subsets, values, bottom=bottom, label=name)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_ylabel("schemas")
    ax.set_title("tool calls per JSONSchemaBench subset")
    ax.tick_params(axis="x", labelrotation=30, labelsize="small")
    ax.legend(fontsize="small")
    return save_figure(fig, path)

