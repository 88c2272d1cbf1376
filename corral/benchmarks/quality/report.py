"""From judged answers to the summary rows (one per server × task × mode), the printed table and the PNG."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from corral.benchmarks.harness import pyplot, save_figure
from corral.benchmarks.quality.answers import Answer

# OpenAI's finish_reason for an answer the budget ended: cut (`length`), or closed early (`closed`, corral only).
BUDGET = "length"
CLOSED = "closed"
UNCONSTRAINED = "unconstrained"
# How a server says the answer ended by itself (not by the budget): a grammar that holds lets it end only valid.
FINISHED = ("stop", "tool_calls")


def unenforced(answer: Answer) -> bool:
    """A constrained answer that ended by itself and does not validate: the server did not enforce (all of) the
    shape — it ignored the field on this path (llama-server reads `response_format` on chat only), or its
    grammar compiler dropped part of the schema (llama-server accepts any string for a `pattern` it cannot
    convert). Words where tool_choice `auto` allowed them are not: that branch is free."""
    return (answer.mode != UNCONSTRAINED and answer.status == "ok" and answer.finish_reason in FINISHED
            and answer.corral_finish_reason in (None, *FINISHED) and not answer.valid
            and not answer.words_for_a_call)


def _rate(count: int, total: int) -> float | None:
    return count / total if total else None


def summarise(answers: Sequence[Answer]) -> list[dict[str, Any]]:
    """One row per (server, task, mode), in the order the answers came. Rates are over every item asked
    (a refusal or error counts as not parsed, not valid, wrong); tokens and speed over the answered ones."""
    groups: dict[tuple[str, str, str], list[Answer]] = {}
    for a in answers:
        groups.setdefault((a.server, a.task, a.mode), []).append(a)
    rows = []
    for (server, task, mode), group in groups.items():
        n = len(group)
        answered = [a for a in group if a.status == "ok"]
        tokens = sum(a.completion_tokens for a in answered)
        seconds = sum((a.client_ms or 0.0) for a in answered) / 1000
        per_field: dict[str, list[bool]] = {}
        for a in group:
            for name, right in a.fields.items():
                per_field.setdefault(name, []).append(right)
        rows.append({
            "server": server, "task": task, "mode": mode, "items": n, "answered": len(answered),
            "refused": sum(a.status == "refused" for a in group), "errors": sum(a.status == "error" for a in group),
            "parse_rate": _rate(sum(a.parsed for a in group), n),
            "valid_rate": _rate(sum(a.valid for a in group), n),
            "exact_accuracy": _rate(sum(a.exact for a in group), n),
            "field_accuracy": sum(a.field_accuracy for a in group) / n,
            "per_field": {name: sum(v) / len(v) for name, v in per_field.items()},
            "tokens_per_answer": tokens / len(answered) if answered else None,
            "tokens_per_s": tokens / seconds if seconds > 0 else None,
            "finish_reasons": dict(Counter(a.finish for a in group).most_common()),
            "closed": sum(a.corral_finish_reason == CLOSED for a in answered),
            "cut": sum(a.finish_reason == BUDGET and a.corral_finish_reason != CLOSED for a in answered),
            "overlong": sum(a.overlong for a in group),
            "unenforced": sum(unenforced(a) for a in group),
            "no_call": sum(a.words_for_a_call for a in group),  # tool_choice auto: answered in words
            "backends": dict(Counter(a.backend for a in answered if a.backend).most_common()),
        })
    return rows


COLUMNS = ("server", "task", "mode", "n", "parse", "valid", "exact", "fields", "tok/ans", "tok/s", "finish")


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value:.0%}"


def table_rows(rows: Sequence[dict[str, Any]]) -> list[list[str]]:
    return [[r["server"], r["task"], r["mode"], str(r["items"]), _pct(r["parse_rate"]), _pct(r["valid_rate"]),
             _pct(r["exact_accuracy"]), _pct(r["field_accuracy"]),
             "–" if r["tokens_per_answer"] is None else f"{r['tokens_per_answer']:.1f}",
             "–" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.1f}",
             " ".join(f"{k}:{v}" for k, v in r["finish_reasons"].items())] for r in rows]


def series_label(row: dict[str, Any]) -> str:
    return row["mode"] if row["server"] == "corral" else f"{row['server']} {row['mode']}"


def quality_plot(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """Exact accuracy and valid rate per task, one bar per (server, mode)."""
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    series = list(dict.fromkeys(series_label(r) for r in rows))
    by_key = {(r["task"], series_label(r)): r for r in rows}
    fig, axes = pyplot().subplots(2, 1, figsize=(max(8.0, 1.3 * len(tasks) + 2), 7), sharex=True)
    width = 0.8 / max(len(series), 1)
    for ax, metric, title in ((axes[0], "exact_accuracy", "exact accuracy"), (axes[1], "valid_rate", "valid rate")):
        for s, label in enumerate(series):
            values = [(by_key.get((t, label)) or {}).get(metric) or 0.0 for t in tasks]
            ax.bar([i + s * width - 0.4 + width / 2 for i in range(len(tasks))], values, width, label=label)
        ax.set_ylim(0, 1.05)
        ax.set_ylabel(title)
    axes[0].set_title("corral bench quality: per task and mode")
    axes[0].legend(fontsize="small", ncol=min(len(series), 4))
    axes[1].set_xticks(range(len(tasks)), tasks, rotation=25, ha="right", fontsize="small")
    return save_figure(fig, path)
