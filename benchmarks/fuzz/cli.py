"""`corral bench fuzz`: argument parsing, the server it starts (or --server), the table and results.json."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def add_fuzz_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "fuzz",
        help="schemathesis over corral's OpenAPI document: 5xx, lost connections, error shapes, fail-open",
        description="Generates requests from the server's /openapi.json with schemathesis (each operation, "
        "cases that fit the schema and cases that do not), sends them over one kept-alive connection and "
        "judges every answer: no 5xx, no lost connection, every 4xx in OpenAI's error shape, no answer that "
        "ends stop/tool_calls and breaks its constraint; then checks the server is still healthy. Writes "
        "OUT/results.json. Exits 1 if any of those is seen.",
    )
    p.add_argument("--requests", type=int, default=2000, metavar="N", help="about N requests (default 2000)")
    p.add_argument("--seed", type=int, default=None,
                   help="hypothesis seed (default: derandomized, the same cases every run)")
    p.add_argument("--server", default=None, metavar="URL",
                   help="a running corral (default: start one as a subprocess and stop it at the end)")
    p.add_argument("--server-args", default="", metavar="ARGS", help="extra `corral serve` flags for that server")
    p.add_argument("--out", type=Path, default=Path("bench-out/fuzz"), metavar="DIR",
                   help="results folder (default bench-out/fuzz)")
    p.add_argument("--log-level", default="warning")
    p.set_defaults(handler=run_fuzz_bench)


def run_fuzz_bench(args: argparse.Namespace) -> int:
    from benchmarks.fuzz.runner import run_fuzz
    from benchmarks.serve.cli import RichProgress, bench_console
    from benchmarks.serve.server_proc import corral_server

    console = bench_console(args.log_level, width=160)
    if args.requests < 1:
        console.print("[red]corral bench fuzz: --requests must be at least 1[/red]")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        with corral_server(args.server, args.server_args, args.out / "server.log") as (url, command), \
                RichProgress(console) as progress:
            progress.phase("fuzz", args.requests)
            report = run_fuzz(url, args.requests, seed=args.seed,
                              on_request=lambda label, _: progress.advance(label))
    except RuntimeError as exc:
        console.print(f"[red]corral bench fuzz: {exc}[/red]")
        return 1
    results = {"config": {"requests": args.requests, "seed": args.seed, "server": args.server or command},
               **report.as_json()}
    path = args.out / "results.json"
    path.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    _print_report(console, results)
    console.print(f"wall time {report.wall_s:.1f} s; wrote {path}")
    summary = results["summary"]
    clean = not (summary["5xx"] or summary["fail_open"] or summary["bad_error_shape"] or summary["lost"])
    return 0 if clean and summary["healthy_after"] else 1


def _print_report(console: Any, results: dict[str, Any]) -> None:
    from rich.table import Table

    summary = results["summary"]
    table = Table(title="corral bench fuzz")
    for name in ("requests", "distinct cases", "2xx", "4xx", "5xx", "lost", "bad error shape", "fail-open",
                 "healthy after"):
        table.add_column(name, justify="right")
    statuses = summary["statuses"]
    healthy = "yes" if summary["healthy_after"] else "NO"
    table.add_row(str(summary["requests"]), str(summary["distinct_cases"]), str(statuses.get("2xx", 0)),
                  str(statuses.get("4xx", 0)), str(summary["5xx"]), str(summary["lost"]),
                  str(summary["bad_error_shape"]), str(summary["fail_open"]), healthy)
    console.print(table)
    per_op = Table(title="per operation")
    per_op.add_column("operation")
    for name in ("2xx", "4xx", "5xx", "lost"):
        per_op.add_column(name, justify="right")
    for op, counts in results["per_operation"].items():
        per_op.add_row(op, *(str(counts.get(name, 0)) for name in ("2xx", "4xx", "5xx", "lost")))
    console.print(per_op)
    for kind in ("server_errors", "lost", "bad_error_shape", "fail_open"):
        for item in results[kind][:5]:
            console.print(f"[red]{kind}[/red] {item['operation']}: {item.get('problem') or item.get('error')}")
