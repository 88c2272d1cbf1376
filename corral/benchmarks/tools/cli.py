"""`corral bench tools`: argument parsing and the report (tables)."""

from __future__ import annotations

import argparse
from typing import Any

from corral.benchmarks.harness import DATA_HELP, Bench, BenchExit, bench_command, config_from_args, exit_on
from corral.benchmarks.tools.workload import TOOL_CHOICES


def add_tools_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    with bench_command(
        sub, "tools", run_tools,
        help="tool-call compliance: JSONSchemaBench schemas as function parameters, a call required",
        description="Sends each schema as the `parameters` of one function (tools=[{type: function, function: "
        "{name, parameters}}], tool_choice required) to a corral it starts (or --server URL) and validates "
        "every returned call's arguments against its schema with the full validator. Counts schemas tried, "
        "refused (400, with messages), answered with tool_calls, valid calls, finish reasons. Writes "
        "OUT/results.json and OUT/tool_calls.png. Exits 3 when the server does not support tools (one probe "
        "request shows it).",
        data=DATA_HELP, server="a running server (default: start a corral as a subprocess and stop it at the end)",
        server_args="extra `corral serve` flags for the server the benchmark starts", out="bench-out/tools",
        log_level=True,
    ) as p:
        p.add_argument("--schemas", type=int, default=200, metavar="N",
                       help="schemas tried, spread over the subsets as in `bench serve` (default 200)")
        p.add_argument("--concurrency", type=int, default=4, help="requests in flight (default 4)")
        p.add_argument("--max-tokens", type=int, default=256, help="max_tokens per request (default 256)")
        p.add_argument("--tool-choice", choices=TOOL_CHOICES, default="required",
                       help="required, auto, or named (the one function by name) (default required)")
        p.add_argument("--model", default=None, metavar="NAME", help="the `model` field to send (default: none)")
        p.add_argument("--api-key", default=None, metavar="KEY", help="bearer token for --server")


def run_tools(args: argparse.Namespace, bench: Bench) -> int:
    from corral.benchmarks.tools.runner import ToolsBenchConfig, ToolsUnsupported, run_tools_bench

    with exit_on(ValueError, 2):
        config = config_from_args(ToolsBenchConfig, args)
    with exit_on(RuntimeError, 1):
        try:
            with bench.progress() as progress:
                report = run_tools_bench(config, progress)
        except ToolsUnsupported as exc:
            raise BenchExit(str(exc), 3, "yellow") from exc
    _print_report(bench, report)
    return 0


def _print_report(bench: Bench, report: dict[str, Any]) -> None:
    from corral.benchmarks.tools.report import OUTCOMES, summary_rows

    summary = report["summary"]
    bench.table(f"corral bench tools (tool_choice={report['config']['tool_choice']})", ["count", "value"],
                summary_rows(summary))
    bench.table("per subset", ["subset", *OUTCOMES], [[subset, *(str(counts[name]) for name in OUTCOMES)]
                                                       for subset, counts in report["per_subset"].items()])
    for message, count in list(summary["refusal_messages"].items())[:10]:
        bench.console.print(f"refused ×{count}: {message}")
    bench.wrote(*report["files"], wall_s=report["wall_s"])
