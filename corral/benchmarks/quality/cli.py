"""`corral bench quality`: argument parsing and the printed report."""

from __future__ import annotations

import argparse
import json
from typing import Any

from corral.benchmarks.harness import Bench, bench_command, config_from_args, exit_on

# Kept here as literals (not imported from the package) so that building the parser loads nothing else.
MODES = ("unconstrained", "xgrammar", "llguidance", "auto")
PEER_CONSTRAINTS = ("response_format", "structured_outputs", "json_schema")
TOOL_CHOICES = ("required", "auto")


def add_quality_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    with bench_command(
        sub, "quality", run_quality,
        help="task accuracy with and without constraints (JSONSchemaBench's quality axis)",
        description="Asks a model generated task suites with ground truth (field extraction, normalisation, "
        "classification as JSON and as a choice, a nested order, tool-call arguments, arithmetic with and "
        "without a reasoning field; and, harder, a nested contact card, a list of records from a log with "
        "corrections, dates and amounts to normalise, one call among twelve tools) unconstrained and under each "
        "backend, and scores every answer: parse rate, "
        "valid rate (Draft 2020-12), exact and per-field accuracy, tokens per answer, tok/s, finish reasons. "
        "Writes OUT/results.json and OUT/quality.png. See docs/quality.md.",
        server="a running corral (default: start one as a subprocess and stop it at the end)",
        server_args="`corral serve` flags for the server the benchmark starts",
        server_args_default="--model gemma-3-270m", out="bench-out/quality", log_level=True, width=200,
    ) as p:
        p.add_argument("--api", choices=("completions", "chat"), default="completions",
                       help="completions: a few-shot `prompt` for a base model; chat: `messages` through the "
                       "chat template (tool calls always use chat) (default completions)")
        p.add_argument("--modes", default=",".join(MODES), metavar="LIST",
                       help=f"comma-separated, of {', '.join(MODES)} (default all)")
        p.add_argument("--tasks", default="", metavar="LIST",
                       help="comma-separated task names (default all; see docs/quality.md)")
        p.add_argument("--items", type=int, default=None, metavar="N", help="the first N items of each task "
                       "(default all, 20)")
        p.add_argument("--shots", type=int, choices=(0, 1), default=1,
                       help="worked examples before the item (default 1)")
        p.add_argument("--tool-choice", choices=TOOL_CHOICES, default="required",
                       help="the tool_choice the constrained modes of a tool task send: required (a call is "
                       "forced) or auto (the model may answer in words instead, scored as a miss with finish "
                       "no_call); unconstrained always sends none (default required)")
        p.add_argument("--max-tokens", type=int, default=128, help="max_tokens per request (default 128)")
        p.add_argument("--temperature", type=float, default=0.0, help="temperature (default 0, greedy)")
        p.add_argument("--concurrency", type=int, default=4, help="requests in flight (default 4)")
        p.add_argument("--model", default=None, metavar="NAME", help="the `model` field sent to corral")
        p.add_argument("--api-key", default=None, metavar="KEY", help="bearer token for --server")
        p.add_argument("--extra-body", default=None, metavar="JSON",
                       help="a JSON object merged into every corral request, to measure a request option, "
                       "e.g. '{\"close_answers\": false}'")
        peer = p.add_argument_group("peer", "ask another OpenAI-compatible server the same items in the same run "
                                    "(after corral); see docs/quality.md")
        peer.add_argument("--peer-url", default=None, metavar="URL", help="a running peer (default: none)")
        peer.add_argument("--peer-model", default=None, metavar="NAME",
                          help="the peer's model name (default: the first id its /v1/models lists)")
        peer.add_argument("--peer-constraint", choices=PEER_CONSTRAINTS, default="response_format",
                          help="how the peer is asked for the shape: OpenAI's response_format json_schema "
                          "(default; llama-server reads it on chat only), structured_outputs (vLLM), or a "
                          "top-level json_schema (llama-server's own, read on /v1/completions and chat alike)")
        peer.add_argument("--peer-api-key", default=None, metavar="KEY", help="bearer token for the peer")


def _names(text: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in text.split(",") if n.strip())


def _extra_body(text: str | None) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--extra-body is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError("--extra-body must be a JSON object")
    return value


def run_quality(args: argparse.Namespace, bench: Bench) -> int:
    from corral.benchmarks.quality.runner import QualityBenchConfig, run_quality_bench
    from corral.benchmarks.quality.suites import load_tasks

    with exit_on(ValueError, 2):
        config = config_from_args(QualityBenchConfig, args, modes=_names(args.modes), tasks=_names(args.tasks),
                                  extra_body=_extra_body(args.extra_body))
        load_tasks(list(config.tasks) or None, config.items)  # an unknown task is a refused flag, before any work
    with exit_on(RuntimeError, 1), bench.progress() as progress:
        report = run_quality_bench(config, progress)
    _print_report(bench, report)
    return 0


def _print_report(bench: Bench, report: dict[str, Any]) -> None:
    from corral.benchmarks.quality.report import COLUMNS, table_rows

    config = report["config"]
    bench.table(f"corral bench quality (api {config['api']}, {config['shots']}-shot, tool_choice "
                f"{config.get('tool_choice', 'required')}, max_tokens {config['max_tokens']}, temperature "
                f"{config['temperature']:g})", COLUMNS,
                table_rows(report["summary"]), left=("server", "task", "mode", "finish"))
    for row in report["summary"]:
        if row["refused"] or row["errors"]:
            bench.console.print(f"{row['server']} {row['task']}/{row['mode']}: refused {row['refused']}, "
                                f"errors {row['errors']} (messages in results.json)")
        if row.get("unenforced"):
            bench.console.print(f"{row['server']} {row['task']}/{row['mode']}: {row['unenforced']} of {row['items']} "
                                "answers ended by themselves yet do not validate: the constraint was not enforced "
                                "(a field the server ignores on this path, or a schema part its compiler dropped)")
        if row.get("no_call"):
            bench.console.print(f"{row['server']} {row['task']}/{row['mode']}: {row['no_call']} of {row['items']} "
                                "answers were words, not a call (tool_choice auto), scored as misses")
    bench.wrote(*report["files"], wall_s=report["wall_s"])
