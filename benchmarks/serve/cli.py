"""`corral bench serve`: argument parsing and the rich console (table, ratios, progress bar)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any


def add_serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve",
        help="serving load benchmark: constrained vs unconstrained at several concurrency levels",
        description="Drives a corral server over HTTP with JSONSchemaBench schemas at each concurrency level, "
        "constrained and unconstrained (same prompts, same max_tokens; unconstrained ignores EOS), and, in the "
        "same run, a naive baseline (transformers generate + xgrammar's HF logits processor, one request at a "
        "time). Writes OUT/results.json and OUT/throughput.png.",
    )
    p.add_argument("--data", type=Path, required=True, metavar="DIR",
                   help="JSONSchemaBench root with <Subset>/*.json")
    p.add_argument("--server", default=None, metavar="URL",
                   help="a running corral (default: start one as a subprocess and stop it at the end)")
    p.add_argument("--server-args", default="", metavar="ARGS",
                   help="extra `corral serve` flags for the server the benchmark starts, e.g. '--max-batch 32'")
    p.add_argument("--schemas", type=int, default=32, metavar="N",
                   help="schemas, spread over the subsets; refused ones (400) are counted and replaced (default 32)")
    p.add_argument("--concurrency", default="1,4,16", metavar="LIST",
                   help="comma-separated concurrency levels (default 1,4,16)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens per request (default 64)")
    p.add_argument("--requests-per-level", type=int, default=None, metavar="N",
                   help="requests per (mode, concurrency) run (default: the number of schemas)")
    p.add_argument("--backend", default="auto", help="structured_outputs.backend (default auto)")
    p.add_argument("--out", type=Path, default=Path("bench-out/serve"), metavar="DIR",
                   help="results folder (default bench-out/serve)")
    p.add_argument("--no-baseline", dest="baseline", action="store_false",
                   help="skip the transformers generate baseline")
    p.add_argument("--log-level", default="warning")
    p.set_defaults(handler=run_serve)


def parse_levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise ValueError(f"--concurrency must be integers separated by commas, got {text!r}") from exc
    if not levels:
        raise ValueError("--concurrency needs at least one level")
    return levels


def run_serve(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.logging import RichHandler

    console = Console()
    if not console.is_terminal:  # logs and CI: keep the wide table readable
        console = Console(width=220)
    logging.basicConfig(level=args.log_level.upper(), format="%(message)s",
                        handlers=[RichHandler(console=console, show_path=False)])
    from benchmarks.serve.runner import ServeBenchConfig, run_serve_bench

    try:
        if not args.data.is_dir():
            raise ValueError(f"--data {args.data} is not a directory")
        config = ServeBenchConfig(
            data=args.data, out=args.out, server=args.server, server_args=args.server_args, schemas=args.schemas,
            concurrency=parse_levels(args.concurrency), max_tokens=args.max_tokens,
            requests_per_level=args.requests_per_level, backend=args.backend, baseline=args.baseline)
    except ValueError as exc:
        console.print(f"[red]corral bench serve: {exc}[/red]")
        return 2
    try:
        with _RichProgress(console) as progress:
            results = run_serve_bench(config, progress)
    except RuntimeError as exc:
        console.print(f"[red]corral bench serve: {exc}[/red]")
        return 1
    _print_report(console, results)
    return 0


class _RichProgress:
    def __init__(self, console: Any) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self._progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TimeElapsedColumn(), TextColumn("{task.fields[last]}"), console=console)
        self._task: Any = None

    def __enter__(self) -> _RichProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def phase(self, label: str, total: int) -> None:
        self._task = self._progress.add_task(label, total=total, last="")

    def advance(self, detail: str = "") -> None:
        if self._task is not None:
            self._progress.update(self._task, advance=1, last=detail)


def _print_report(console: Any, results: dict[str, Any]) -> None:
    from rich.table import Table

    from benchmarks.serve.report import COLUMNS, ratio_lines, table_rows

    table = Table(title="corral bench serve")
    for _, header, _ in COLUMNS:
        table.add_column(header, justify="left" if header in ("mode", "finish") else "right")
    for row in table_rows(results["runs"], results["baseline"]):
        table.add_row(*row)
    console.print(table)
    for line in ratio_lines(results["ratios"]):
        console.print(line)
    schemas = results["schemas"]
    console.print(f"schemas used {len(schemas['used'])} of {schemas['requested']} requested; refused (400) "
                  f"{len(schemas['refused'])}; other errors {len(schemas['errors'])}")
    console.print(f"wall time {results['wall_s']:.1f} s; wrote {', '.join(results['files'])}")
