"""`corral bench ...`: benchmark subcommands (jsonschemabench, serve, peer-model, tools, sampler, projection,
prefix, engine, mediation, startup, fuzz, soak)."""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import Any

DEFAULT_BACKENDS = "xgrammar,llguidance,auto"


def add_bench_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = sub.add_parser("bench", help="run a benchmark", description="Benchmarks of corral's grammar backends.")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    _add_jsonschemabench(bench_sub)
    from benchmarks.engine.cli import add_engine_parser
    from benchmarks.mediation.cli import add_mediation_parser
    from benchmarks.prefix.cli import add_prefix_parser
    from benchmarks.projection.cli import add_projection_parser
    from benchmarks.sampler.cli import add_sampler_parser
    from benchmarks.serve.cli import add_peer_model_parser, add_serve_parser  # the serving load benchmark
    from benchmarks.tools.cli import add_tools_parser

    add_serve_parser(bench_sub)
    add_peer_model_parser(bench_sub)
    add_tools_parser(bench_sub)
    add_sampler_parser(bench_sub)
    add_projection_parser(bench_sub)
    add_prefix_parser(bench_sub)
    add_engine_parser(bench_sub)
    add_mediation_parser(bench_sub)
    from benchmarks.startup.cli import add_startup_parser

    add_startup_parser(bench_sub)
    from benchmarks.fuzz.cli import add_fuzz_parser  # issue 13: hostile-input fuzzing and soak
    from benchmarks.soak.cli import add_soak_parser

    add_fuzz_parser(bench_sub)
    add_soak_parser(bench_sub)


def _add_jsonschemabench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "jsonschemabench",
        help="coverage, correctness and speed of each backend on JSONSchemaBench",
        description="Per schema × backend: declared coverage and compile time; masks mode teacher-forces the "
        "test instances (soundness, strictness, per-token mask µs); generate mode runs constrained "
        "generation (empirical coverage, compliance, TTFT, TPOT). Results are appended to OUT/<mode>.jsonl "
        "and a rerun skips schema × backend pairs already there.",
    )
    p.add_argument("--data", type=Path, required=True, metavar="DIR",
                   help="folder with <Subset>/*.json (MaskBench format)")
    p.add_argument("--subsets", nargs="+", default=None, metavar="NAME",
                   help="subset folders (default: all found)")
    p.add_argument("--backends", default=DEFAULT_BACKENDS,
                   help=f"comma-separated, 'auto' included (default {DEFAULT_BACKENDS})")
    p.add_argument("--mode", choices=["masks", "generate"], default="masks")
    p.add_argument("--limit", type=int, default=None, metavar="N",
                   help="schemas per subset: N file names evenly spaced over the sorted list (default: all)")
    p.add_argument("--workers", type=int, default=1,
                   help="schemas run concurrently (masks: threads; generate: requests in flight). "
                   "Keep 1 for clean mask timings")
    p.add_argument("--out", type=Path, default=Path("bench-out"), metavar="DIR",
                   help="results folder (default bench-out)")
    p.add_argument("--tokenizer", type=Path, default=None, metavar="DIR",
                   help="masks mode: a local Hugging Face tokenizer (default: corral-tiny's)")
    p.add_argument("--server", default=None, metavar="URL",
                   help="generate mode: a running corral (default: in process)")
    p.add_argument("--compile-timeout", type=float, default=10.0, metavar="S",
                   help="per compile, seconds (default 10)")
    p.add_argument("--gen-timeout", type=float, default=60.0, metavar="S",
                   help="per generation, seconds (default 60)")
    p.add_argument("--max-tokens", type=int, default=512,
                   help="generate mode: max tokens per answer (default 512)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="generate mode: sampling temperature (default 0, greedy)")
    p.add_argument("--isolate", action="store_true",
                   help="masks mode: compile in killable worker processes as the server does (a timeout costs "
                   "exactly --compile-timeout; GCT then includes shipping the grammar back)")
    p.add_argument("--compile-workers", type=int, default=None, metavar="N",
                   help="with --isolate: compile worker processes (default: --workers, at least 2)")
    p.add_argument("--log-level", default="warning")
    p.set_defaults(handler=run_jsonschemabench)


def run_jsonschemabench(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.logging import RichHandler

    console = Console()
    if not console.is_terminal:  # logs and CI: do not squeeze the 15-column tables into 80 characters
        console = Console(width=200)
    logging.basicConfig(level=args.log_level.upper(), format="%(message)s",
                        handlers=[RichHandler(console=console, show_path=False)])
    from benchmarks.jsonschemabench.results import ResultStore
    from benchmarks.jsonschemabench.runner import BenchConfig, plan

    try:
        config = BenchConfig(
            data=args.data, out=args.out, backends=[b.strip() for b in args.backends.split(",") if b.strip()],
            mode=args.mode, subsets=args.subsets, limit=args.limit, workers=args.workers, tokenizer=args.tokenizer,
            server=args.server, compile_timeout_s=args.compile_timeout, gen_timeout_s=args.gen_timeout,
            max_tokens=args.max_tokens, temperature=args.temperature, isolate=args.isolate,
            compile_workers=args.compile_workers,
        )
        if not config.data.is_dir():
            raise ValueError(f"--data {config.data} is not a directory")
        store = ResultStore(config.out, config.mode)
        work = plan(config, store)
    except ValueError as exc:
        console.print(f"[red]corral bench: {exc}[/red]")
        return 2
    console.print(f"{len(work.cases)} schemas × {len(config.backends)} backends; {work.pending} to run "
                  f"({len(work.cases) * len(config.backends) - work.pending} already in {store.path})")
    started = time.perf_counter()
    if work.pending:
        _run_with_progress(config, work, store, console)
    return _report(config, store, work, console, time.perf_counter() - started)


def _run_with_progress(config: Any, work: Any, store: Any, console: Any) -> None:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from benchmarks.jsonschemabench.runner import run_generate_plan, run_masks_plan

    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[last]}"))
    with Progress(*columns, console=console) as progress:
        task = progress.add_task(f"{config.mode}", total=work.pending, last="")

        def on_record(record: dict[str, Any]) -> None:
            progress.update(task, advance=1, last=f"{record['subset']}/{record['schema'][:24]} {record['backend']}: "
                            f"{record['status']}")

        runner = run_masks_plan if config.mode == "masks" else run_generate_plan
        runner(config, work, store, on_record)


def _report(config: Any, store: Any, work: Any, console: Any, wall_s: float) -> int:
    from rich.markdown import Markdown

    from benchmarks.jsonschemabench.runner import write_report

    report = write_report(config, store, work.cases, wall_s)
    for title, table in report.tables.items():
        console.print(Markdown(f"## {title}\n\n{table.markdown()}"))
    console.print(f"wall time {wall_s:.1f} s; wrote " + ", ".join(str(p) for p in report.files))
    return 0
