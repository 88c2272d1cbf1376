"""`corral bench serve`: argument parsing and the rich console (table, ratios, progress bar)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from benchmarks.serve.peer import PEER_HEAD_DIM
from benchmarks.serve.workload import CONSTRAINT_FIELDS


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
    p.add_argument("--temperature", type=float, default=0.0,
                   help="temperature of every timed request, corral's and the peer's (default 0, greedy; "
                   "OpenAI's own default is 1). The baseline stays greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="top_p of every timed request (default 1, off)")
    p.add_argument("--out", type=Path, default=Path("bench-out/serve"), metavar="DIR",
                   help="results folder (default bench-out/serve)")
    p.add_argument("--no-baseline", dest="baseline", action="store_false",
                   help="skip the transformers generate baseline")
    peer = p.add_argument_group("peer", "drive another OpenAI-compatible server (vLLM, SGLang, ...) with the same "
                                "requests in the same run, one side after the other; see docs/serving-benchmark.md")
    peer.add_argument("--peer-url", default=None, metavar="URL",
                      help="a running peer server, e.g. http://127.0.0.1:8001 (default: no peer)")
    peer.add_argument("--peer-model", default=None, metavar="NAME",
                      help="the peer's model name (default: the first id its /v1/models lists)")
    peer.add_argument("--peer-constraint", choices=CONSTRAINT_FIELDS, default="structured_outputs",
                      help="how constrained requests ask the peer for the schema: structured_outputs: {json: "
                      "schema} (current vLLM), guided_json: schema (older vLLM; 0.32 silently ignores it), or "
                      "OpenAI's response_format json_schema (default structured_outputs)")
    peer.add_argument("--peer-api-key", default=None, metavar="KEY", help="bearer token for the peer")
    p.add_argument("--log-level", default="warning")
    p.set_defaults(handler=run_serve)


def add_peer_model_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "peer-model",
        help="write the default model re-laid out to head_dim 32, for vLLM-cpu as a `bench serve` peer",
        description="Writes an exact re-layout of a Llama checkpoint (default: the tiny model, corral-tiny) with "
        "wider attention heads: q/k/v heads zero-padded, rope_theta raised and q rescaled so the function is "
        "unchanged (transformers gives the same logits within float error). vLLM-cpu refuses head_dim 16.",
    )
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="where to write the checkpoint")
    p.add_argument("--model", type=Path, default=None, metavar="DIR",
                   help="the Llama checkpoint to re-lay out (default: the tiny model, corral-tiny)")
    p.add_argument("--head-dim", type=int, default=PEER_HEAD_DIM, help=f"new head_dim (default {PEER_HEAD_DIM})")
    p.set_defaults(handler=run_peer_model)


def run_peer_model(args: argparse.Namespace) -> int:
    from rich.console import Console

    from benchmarks.serve.peer_model import write_peer_model

    console = Console()
    source = args.model
    if source is None:
        from server.models.default_model import ensure_default_model

        source = ensure_default_model()
    try:
        out = write_peer_model(source, args.out, args.head_dim)
    except (ValueError, OSError) as exc:
        console.print(f"[red]corral bench peer-model: {exc}[/red]")
        return 2
    console.print(f"wrote {out} (from {source}, head_dim {args.head_dim})")
    return 0


def parse_levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise ValueError(f"--concurrency must be integers separated by commas, got {text!r}") from exc
    if not levels:
        raise ValueError("--concurrency needs at least one level")
    return levels


def run_serve(args: argparse.Namespace) -> int:
    console = bench_console(args.log_level, width=220)
    from benchmarks.serve.runner import ServeBenchConfig, run_serve_bench

    try:
        if not args.data.is_dir():
            raise ValueError(f"--data {args.data} is not a directory")
        config = ServeBenchConfig(
            data=args.data, out=args.out, server=args.server, server_args=args.server_args, schemas=args.schemas,
            concurrency=parse_levels(args.concurrency), max_tokens=args.max_tokens,
            requests_per_level=args.requests_per_level, backend=args.backend, baseline=args.baseline,
            peer_url=args.peer_url, peer_model=args.peer_model, peer_constraint=args.peer_constraint,
            peer_api_key=args.peer_api_key, temperature=args.temperature, top_p=args.top_p)
    except ValueError as exc:
        console.print(f"[red]corral bench serve: {exc}[/red]")
        return 2
    try:
        with RichProgress(console) as progress:
            results = run_serve_bench(config, progress)
    except RuntimeError as exc:
        console.print(f"[red]corral bench serve: {exc}[/red]")
        return 1
    _print_report(console, results)
    return 0


def bench_console(log_level: str, width: int) -> Any:
    """A rich console for tables and progress, logging through it; `width` when not a terminal (logs and
    CI), so wide tables stay readable."""
    from rich.console import Console
    from rich.logging import RichHandler

    console = Console()
    if not console.is_terminal:
        console = Console(width=width)
    logging.basicConfig(level=log_level.upper(), format="%(message)s",
                        handlers=[RichHandler(console=console, show_path=False)])
    return console


class RichProgress:
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

    def __enter__(self) -> RichProgress:
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
    peer = results.get("peer")
    for row in table_rows(results["runs"], results["baseline"], peer["runs"] if peer else ()):
        table.add_row(*row)
    console.print(table)
    for line in ratio_lines(results["ratios"]):
        console.print(line)
    schemas = results["schemas"]
    console.print(f"schemas used {len(schemas['used'])} of {schemas['requested']} requested; refused (400) "
                  f"{len(schemas['refused'])}; other errors {len(schemas['errors'])}")
    if peer:
        console.print(f"peer {peer['model']} at {peer['url']} ({peer['constraint']}): refused (400) "
                      f"{len(peer['refused'])}, other errors {len(peer['errors'])} of corral's schemas "
                      "(dropped from both sides' timed runs)")
    console.print(f"wall time {results['wall_s']:.1f} s; wrote {', '.join(results['files'])}")
