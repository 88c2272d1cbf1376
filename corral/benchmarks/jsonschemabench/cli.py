"""`corral bench jsonschemabench`: argument parsing, the progress bar and the Markdown tables."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from corral.benchmarks.harness import Bench, bench_command, config_from_args, exit_on

DEFAULT_BACKENDS = "xgrammar,llguidance,auto"


def add_jsonschemabench_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    with bench_command(
        sub, "jsonschemabench", run_jsonschemabench,
        help="coverage, correctness and speed of each backend on JSONSchemaBench",
        description="Per schema × backend: declared coverage and compile time; masks mode teacher-forces the "
        "test instances (soundness, strictness, per-token mask µs); generate mode runs constrained "
        "generation (empirical coverage, compliance, TTFT, TPOT). Results are appended to OUT/<mode>.jsonl "
        "and a rerun skips schema × backend pairs already there.",
        data="folder with <Subset>/*.json (MaskBench format)",
        server="generate mode: a running corral (default: in process)", out="bench-out", log_level=True, width=200,
    ) as p:
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
        p.add_argument("--tokenizer", type=Path, default=None, metavar="DIR",
                       help="masks mode: a local Hugging Face tokenizer (default: corral-tiny's)")
        p.add_argument("--compile-timeout", type=float, default=10.0, metavar="S",
                       help="per compile, seconds (default 10)")
        p.add_argument("--gen-timeout", type=float, default=60.0, metavar="S",
                       help="per generation, seconds (default 60)")
        p.add_argument("--max-tokens", type=int, default=512,
                       help="generate mode: max tokens per answer (default 512)")
        p.add_argument("--temperature", type=float, default=0.0,
                       help="generate mode: sampling temperature (default 0, greedy)")
        p.add_argument("--isolate", action="store_true",
                       help="masks mode: compile in killable worker processes as the server does (a timeout "
                       "costs exactly --compile-timeout; GCT then includes shipping the grammar back)")
        p.add_argument("--compile-workers", type=int, default=None, metavar="N",
                       help="with --isolate: compile worker processes (default: --workers, at least 2)")


def run_jsonschemabench(args: argparse.Namespace, bench: Bench) -> int:
    from corral.benchmarks.jsonschemabench.results import ResultStore
    from corral.benchmarks.jsonschemabench.runner import BenchConfig, plan, write_report

    with exit_on(ValueError, 2):
        config = config_from_args(
            BenchConfig, args, backends=[b.strip() for b in args.backends.split(",") if b.strip()],
            compile_timeout_s=args.compile_timeout, gen_timeout_s=args.gen_timeout)
        store = ResultStore(config.out, config.mode)
        work = plan(config, store)
    bench.console.print(f"{len(work.cases)} schemas × {len(config.backends)} backends; {work.pending} to run "
                        f"({len(work.cases) * len(config.backends) - work.pending} already in {store.path})")
    started = time.perf_counter()
    if work.pending:
        _run_with_progress(config, work, store, bench)
    wall_s = time.perf_counter() - started
    report = write_report(config, store, work.cases, wall_s)
    from rich.markdown import Markdown

    for title, table in report.tables.items():
        bench.console.print(Markdown(f"## {title}\n\n{table.markdown()}"))
    bench.wrote(*report.files, wall_s=wall_s)
    return 0


def _run_with_progress(config: Any, work: Any, store: Any, bench: Bench) -> None:
    from corral.benchmarks.jsonschemabench.runner import run_generate_plan, run_masks_plan

    with bench.progress() as progress:
        progress.phase(config.mode, work.pending)

        def on_record(record: dict[str, Any]) -> None:
            progress.advance(f"{record['subset']}/{record['schema'][:24]} {record['backend']}: {record['status']}")

        runner = run_masks_plan if config.mode == "masks" else run_generate_plan
        runner(config, work, store, on_record)
