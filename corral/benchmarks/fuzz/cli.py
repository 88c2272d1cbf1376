"""`corral bench fuzz`: argument parsing, the server it starts (or --server), the tables and results.json."""

from __future__ import annotations

import argparse
from typing import Any

from corral.benchmarks.harness import SERVER_HELP, Bench, BenchExit, bench_command, exit_on, write_json


def add_fuzz_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    with bench_command(
        sub, "fuzz", run_fuzz_bench,
        help="schemathesis over corral's OpenAPI document: 5xx, lost connections, error shapes, fail-open",
        description="Generates requests from the server's /openapi.json with schemathesis (each operation, "
        "cases that fit the schema and cases that do not), sends them over one kept-alive connection and "
        "judges every answer: no 5xx, no lost connection, every 4xx in OpenAI's error shape, no answer that "
        "ends stop/tool_calls and breaks its constraint; then checks the server is still healthy. Writes "
        "OUT/results.json. Exits 1 if any of those is seen.",
        server=SERVER_HELP, server_args="extra `corral serve` flags for that server", out="bench-out/fuzz",
        log_level=True, needs=("schemathesis",),
    ) as p:
        p.add_argument("--requests", type=int, default=2000, metavar="N", help="about N requests (default 2000)")
        p.add_argument("--seed", type=int, default=None,
                       help="hypothesis seed (default: derandomized, the same cases every run)")


def run_fuzz_bench(args: argparse.Namespace, bench: Bench) -> int:
    from corral.benchmarks.fuzz.runner import run_fuzz
    from corral.benchmarks.serve.server_proc import corral_server

    if args.requests < 1:
        raise BenchExit("--requests must be at least 1")
    with exit_on(RuntimeError, 1), corral_server(args.server, args.server_args, args.out / "server.log") as (
            url, command), bench.progress() as progress:
        progress.phase("fuzz", args.requests)
        report = run_fuzz(url, args.requests, seed=args.seed, on_request=lambda label, _: progress.advance(label))
    results = {"config": {"requests": args.requests, "seed": args.seed, "server": args.server or command},
               **report.as_json()}
    path = write_json(args.out, results)
    _print_report(bench, results)
    bench.wrote(path, wall_s=report.wall_s)
    summary = results["summary"]
    clean = not (summary["5xx"] or summary["fail_open"] or summary["bad_error_shape"] or summary["lost"])
    return 0 if clean and summary["healthy_after"] else 1


def _print_report(bench: Bench, results: dict[str, Any]) -> None:
    summary = results["summary"]
    statuses = summary["statuses"]
    bench.table("corral bench fuzz", ["requests", "distinct cases", "2xx", "4xx", "5xx", "lost", "bad error shape",
                                      "fail-open", "healthy after"],
                [[str(summary["requests"]), str(summary["distinct_cases"]), str(statuses.get("2xx", 0)),
                  str(statuses.get("4xx", 0)), str(summary["5xx"]), str(summary["lost"]),
                  str(summary["bad_error_shape"]), str(summary["fail_open"]),
                  "yes" if summary["healthy_after"] else "NO"]], left=())
    classes = ("2xx", "4xx", "5xx", "lost")
    bench.table("per operation", ["operation", *classes],
                [[op, *(str(counts.get(name, 0)) for name in classes)]
                 for op, counts in results["per_operation"].items()])
    for kind in ("server_errors", "lost", "bad_error_shape", "fail_open"):
        for item in results[kind][:5]:
            bench.console.print(f"[red]{kind}[/red] {item['operation']}: {item.get('problem') or item.get('error')}")
