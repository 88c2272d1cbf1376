"""`corral bench mediation`: argument parsing and the console report."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

MODES = ("schema_constrained", "json_mode", "contract_only")


def add_mediation_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "mediation",
        help="mediation per mode: success rate, attempts, tokens per success, failure classes",
        description="Mediates each of N JSONSchemaBench schemas (with a semantic rule derived from it) through "
        "mediation.Mediator in every mode against a corral it starts (or --server URL). Writes OUT/results.json.",
    )
    p.add_argument("--data", type=Path, required=True, metavar="DIR", help="JSONSchemaBench root with <Subset>/*.json")
    p.add_argument("--schemas", type=int, default=200, metavar="N", help="schemas (default 200)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated (default {','.join(MODES)})")
    p.add_argument("--markers", action="store_true", help="require the BEGIN/END_DISPATCH_RESULT block")
    p.add_argument("--max-attempts", type=int, default=3, help="RepairPolicy.max_attempts (default 3)")
    p.add_argument("--server", default=None, metavar="URL", help="a running corral (default: start one)")
    p.add_argument("--server-args", default="", metavar="ARGS", help="extra `corral serve` flags")
    p.add_argument("--concurrency", type=int, default=4, help="mediated calls in flight (default 4)")
    p.add_argument("--max-tokens", type=int, default=512, help="max_tokens per round (default 512)")
    p.add_argument("--model", default=None, metavar="NAME", help="the `model` field (default: the server's)")
    p.add_argument("--out", type=Path, default=Path("bench-out/mediation"), metavar="DIR",
                   help="results folder (default bench-out/mediation)")
    p.add_argument("--log-level", default="warning")
    p.set_defaults(handler=run_mediation)


def run_mediation(args: argparse.Namespace) -> int:
    from benchmarks.mediation.runner import MediationBenchConfig, run_mediation_bench
    from benchmarks.serve.cli import RichProgress, bench_console

    console = bench_console(args.log_level, width=160)
    try:
        if not args.data.is_dir():
            raise ValueError(f"--data {args.data} is not a directory")
        config = MediationBenchConfig(
            data=args.data, out=args.out, server=args.server, server_args=args.server_args, schemas=args.schemas,
            modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()), markers=args.markers,
            max_attempts=args.max_attempts, concurrency=args.concurrency, max_tokens=args.max_tokens,
            model=args.model)
    except ValueError as exc:
        console.print(f"[red]corral bench mediation: {exc}[/red]")
        return 2
    with RichProgress(console) as progress:
        progress.phase("mediation", config.schemas * len(config.modes))
        try:
            report = run_mediation_bench(config, lambda r: progress.advance(
                f"{r.mode} {r.case_id[:28]}: {'ok' if r.ok else r.failure_class}"))
        except RuntimeError as exc:
            console.print(f"[red]corral bench mediation: {exc}[/red]")
            return 1
    _print_report(console, report)
    return 0


def _print_report(console: Any, report: dict[str, Any]) -> None:
    from rich.table import Table

    console.print(f"{report['schemas']} schemas, {report['declared']} declared by corral")
    for title, key in (("all schemas", "summary"), ("schemas corral declares", "summary_declared")):
        table = Table(title=f"corral bench mediation: {title}")
        for column in ("mode", "calls", "success", "within 2", "mean attempts", "tokens/success", "terminal failures"):
            table.add_column(column)
        for mode, s in report[key].items():
            failures = ", ".join(f"{k} {v}" for k, v in s["terminal_failures"].items()) or "-"
            table.add_row(mode, str(s["calls"]), f"{s['success']} ({s['success_rate']:.1%})" if s["calls"] else "-",
                          str(s["success_within_2"]), str(s["mean_attempts"]), str(s["tokens_per_success"]), failures)
        console.print(table)
    console.print(f"wall time {report['wall_s']:.1f} s; wrote {', '.join(report['files'])}")
