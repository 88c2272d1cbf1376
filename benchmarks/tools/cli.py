"""`corral bench tools`: argument parsing and the rich console (progress bar, tables)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from benchmarks.tools.workload import TOOL_CHOICES


def add_tools_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "tools",
        help="tool-call compliance: JSONSchemaBench schemas as function parameters, a call required",
        description="Sends each schema as the `parameters` of one function (tools=[{type: function, function: "
        "{name, parameters}}], tool_choice required) to a corral it starts (or --server URL) and validates "
        "every returned call's arguments against its schema with the full validator. Counts schemas tried, "
        "refused (400, with messages), answered with tool_calls, valid calls, finish reasons. Writes "
        "OUT/results.json and OUT/tool_calls.png. Exits 3 when the server does not support tools (one probe "
        "request shows it).",
    )
    p.add_argument("--data", type=Path, required=True, metavar="DIR",
                   help="JSONSchemaBench root with <Subset>/*.json")
    p.add_argument("--schemas", type=int, default=200, metavar="N",
                   help="schemas tried, spread over the subsets as in `bench serve` (default 200)")
    p.add_argument("--server", default=None, metavar="URL",
                   help="a running server (default: start a corral as a subprocess and stop it at the end)")
    p.add_argument("--server-args", default="", metavar="ARGS",
                   help="extra `corral serve` flags for the server the benchmark starts")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight (default 4)")
    p.add_argument("--max-tokens", type=int, default=256, help="max_tokens per request (default 256)")
    p.add_argument("--tool-choice", choices=TOOL_CHOICES, default="required",
                   help="required, auto, or named (the one function by name) (default required)")
    p.add_argument("--model", default=None, metavar="NAME", help="the `model` field to send (default: none)")
    p.add_argument("--api-key", default=None, metavar="KEY", help="bearer token for --server")
    p.add_argument("--out", type=Path, default=Path("bench-out/tools"), metavar="DIR",
                   help="results folder (default bench-out/tools)")
    p.add_argument("--log-level", default="warning")
    p.set_defaults(handler=run_tools)


def run_tools(args: argparse.Namespace) -> int:
    from benchmarks.serve.cli import RichProgress, bench_console

    console = bench_console(args.log_level, width=160)
    from benchmarks.tools.runner import ToolsBenchConfig, ToolsUnsupported, run_tools_bench

    try:
        if not args.data.is_dir():
            raise ValueError(f"--data {args.data} is not a directory")
        config = ToolsBenchConfig(
            data=args.data, out=args.out, server=args.server, server_args=args.server_args, schemas=args.schemas,
            concurrency=args.concurrency, max_tokens=args.max_tokens, tool_choice=args.tool_choice,
            model=args.model, api_key=args.api_key)
    except ValueError as exc:
        console.print(f"[red]corral bench tools: {exc}[/red]")
        return 2
    try:
        with RichProgress(console) as progress:
            report = run_tools_bench(config, progress)
    except ToolsUnsupported as exc:
        console.print(f"[yellow]corral bench tools: {exc}[/yellow]")
        return 3
    except RuntimeError as exc:
        console.print(f"[red]corral bench tools: {exc}[/red]")
        return 1
    _print_report(console, report)
    return 0


def _print_report(console: Any, report: dict[str, Any]) -> None:
    from rich.table import Table

    from benchmarks.tools.report import OUTCOMES, summary_rows

    summary = report["summary"]
    table = Table(title=f"corral bench tools (tool_choice={report['config']['tool_choice']})")
    table.add_column("count")
    table.add_column("value", justify="right")
    for label, value in summary_rows(summary):
        table.add_row(label, value)
    console.print(table)
    subsets = Table(title="per subset")
    subsets.add_column("subset")
    for name in OUTCOMES:
        subsets.add_column(name, justify="right")
    for subset, counts in report["per_subset"].items():
        subsets.add_row(subset, *(str(counts[name]) for name in OUTCOMES))
    console.print(subsets)
    for message, count in list(summary["refusal_messages"].items())[:10]:
        console.print(f"refused ×{count}: {message}")
    console.print(f"wall time {report['wall_s']:.1f} s; wrote {', '.join(report['files'])}")
