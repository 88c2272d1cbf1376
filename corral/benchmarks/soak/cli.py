"""`corral bench soak`: argument parsing, the server it starts (or --server), the tables and results.json."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from corral.benchmarks.harness import SERVER_HELP, Bench, BenchExit, bench_command, exit_on, write_json


def add_soak_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    with bench_command(
        sub, "soak", run_soak_bench,
        help="many mixed requests at concurrency 16 with disconnects, cancels and compile bombs beside them",
        description="Warm-up, then a quiet phase of ordinary constrained requests (json_schema, choice, regex, "
        "grammar, tools; streamed and not), then the hostile phase: the same ordinary requests with client "
        "disconnects, cancels, compile bombs and malformed constraints among them. Reports outcomes by class, "
        "ordinary p50/p99 latency quiet vs under hostile load, the server's RSS and open fds after warm-up and "
        "at the end, and compile-worker restarts. Targets: 0 lost or 5xx, RSS growth < 5 %, hostile p99 < 2x "
        "quiet p99. Writes OUT/results.json; exits 1 when a target is missed.",
        server=SERVER_HELP, server_args="`corral serve` flags for the server it starts",
        server_args_default="--compile-timeout-s 3", out="bench-out/soak", log_level=True,
    ) as p:
        p.add_argument("--requests", type=int, default=1000, metavar="N",
                       help="requests in the hostile phase (default 1000)")
        p.add_argument("--concurrency", type=int, default=16, help="requests in flight (default 16)")
        p.add_argument("--quiet-requests", type=int, default=None, metavar="N",
                       help="ordinary requests in the quiet phase (default: a quarter of --requests, at least 32)")
        p.add_argument("--max-tokens", type=int, default=48, help="max_tokens per request (default 48)")
        p.add_argument("--server-pid", type=int, default=None, metavar="PID",
                       help="with --server on this machine: its process id, for RSS and fds")


@contextmanager
def _server(args: argparse.Namespace) -> Iterator[tuple[str, int | None, list[str] | None]]:
    from corral.benchmarks.serve.server_proc import ManagedServer, wait_healthy

    if args.server:
        wait_healthy(args.server.rstrip("/"), 10.0)
        yield args.server.rstrip("/"), args.server_pid, None
        return
    with ManagedServer(args.server_args, args.out / "server.log") as server:
        yield server.url, server.pid, server.command


def run_soak_bench(args: argparse.Namespace, bench: Bench) -> int:
    from corral.benchmarks.soak.runner import SoakConfig, run_soak

    if args.requests < 1 or args.concurrency < 1:
        raise BenchExit("--requests and --concurrency must be at least 1")
    with exit_on(RuntimeError, 1), _server(args) as (url, pid, command), bench.progress() as progress:
        config = SoakConfig(url=url, requests=args.requests, concurrency=args.concurrency,
                            quiet_requests=args.quiet_requests, max_tokens=args.max_tokens, pid=pid)
        result = run_soak(config, on_phase=progress.phase, on_done=lambda o: progress.advance(f"{o.kind} {o.label}"))
    summary = result.summary()
    path = write_json(args.out, {"config": {"requests": args.requests, "concurrency": args.concurrency,
                                            "quiet_requests": config.quiet_count(), "max_tokens": args.max_tokens,
                                            "server": args.server or command}, "summary": summary})
    _print_report(bench, summary)
    bench.wrote(path, wall_s=summary["wall_s"])
    return 0 if all(v is not False for v in summary["targets"].values()) and summary["healthy_after"] else 1


def _print_report(bench: Bench, summary: dict[str, Any]) -> None:
    bench.table("corral bench soak: outcomes by phase/kind", ["phase/kind", "outcomes"],
                [[name, ", ".join(f"{label} {n}" for label, n in sorted(counts.items()))]
                 for name, counts in summary["outcomes"].items()], left=("phase/kind", "outcomes"))
    targets = summary["targets"]
    start, end = summary["process"].get("after_warmup"), summary["process"].get("end")
    rows = [
        ("lost or 5xx", str(summary["lost_or_5xx"]), _verdict(targets["no_lost_or_5xx"], "0")),
        ("fail-open / bad error shape", f"{summary['fail_open']} / {summary['bad_shape']}", ""),
        ("ordinary p50/p99 quiet (ms)", _p(summary["quiet_ms"]), ""),
        ("ordinary p50/p99 hostile (ms)", _p(summary["hostile_ms"]), ""),
        ("hostile p99 / quiet p99", str(summary["p99_ratio"]), _verdict(targets["hostile_p99_under_2x_quiet"], "< 2")),
        ("RSS MB after warm-up -> end", f"{start and start['rss_mb']} -> {end and end['rss_mb']}", ""),
        ("RSS growth %", str(summary["rss_growth_pct"]), _verdict(targets["rss_growth_under_5pct"], "< 5")),
        ("open fds after warm-up -> end", f"{start and start['fds']} -> {end and end['fds']}", ""),
        ("compile workers (RSS MB) at end", f"{end and end['children']} ({end and end['children_rss_mb']})", ""),
        ("compile-worker restarts", str(summary["compile_worker_restarts"]), ""),
        ("healthy after", "yes" if summary["healthy_after"] else "NO", ""),
    ]
    bench.table("figures", ["figure", "value", "target"], rows)
    for problem in summary["problems"]:
        bench.console.print(f"[red]{problem}[/red]")


def _p(latency: dict[str, Any]) -> str:
    return f"{latency.get('p50', '-')} / {latency.get('p99', '-')} (n {latency['n']})"


def _verdict(met: bool | None, target: str) -> str:
    return f"{target}: " + ("n/a" if met is None else "met" if met else "MISSED")
