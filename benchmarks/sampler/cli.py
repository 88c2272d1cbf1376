"""`corral bench sampler`: argument parsing, the table, JSON and PNG."""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.sampler.runner import CONFIGS, run_sampler_bench
from benchmarks.timing_report import plot_pairs, write_results

DEFAULT_VOCAB = 128_257  # the tiny model's (corral-tiny) (Llama 3 tokenizer)


def add_sampler_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "sampler",
        help="CPU cost of the sampling step (argmax, draws, top-k/top-p/min-p) against plain torch",
        description="Times corral's sample_rows against the plain torch step (torch.argmax; torch.multinomial "
        "over the softmax; a full descending sort for the filters) on random logits, per sampling "
        "configuration and batch size, in CPU ms of the calling thread with torch on one thread. Prints a "
        "table, writes OUT/results.json and OUT/sampler.png.",
    )
    p.add_argument("--vocab", type=int, default=DEFAULT_VOCAB, help=f"logits per row (default {DEFAULT_VOCAB})")
    p.add_argument("--batches", default="1,8", metavar="B,B", help="batch sizes (default 1,8)")
    p.add_argument("--repeats", type=int, default=10, help="steps per timing, 3 timings each (default 10)")
    p.add_argument("--scale", type=float, default=4.0,
                   help="logits are standard normal × this; larger is more peaked (default 4)")
    p.add_argument("--out", type=Path, default=Path("bench-out/sampler"), metavar="DIR",
                   help="results folder (default bench-out/sampler)")
    p.set_defaults(handler=run_sampler)


def run_sampler(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    console = Console(width=120)
    try:
        batches = [int(b) for b in args.batches.split(",")]
        if not batches or min(batches) < 1 or args.vocab < 2 or args.repeats < 1:
            raise ValueError
    except ValueError:
        console.print("[red]corral bench sampler: --batches needs positive integers, --vocab >= 2, "
                      "--repeats >= 1[/red]")
        return 2
    with Progress(console=console) as progress:
        task = progress.add_task("sampling configurations", total=len(CONFIGS) * len(batches))
        results = run_sampler_bench(args.vocab, batches, args.repeats, args.scale,
                                    lambda _: progress.advance(task))
    table = Table(title=f"corral bench sampler (vocab {args.vocab}, CPU ms per step, 1 thread)")
    for column in ("configuration", "batch", "corral ms", "plain torch ms", "speedup"):
        table.add_column(column, justify="left" if column == "configuration" else "right")
    for r in results:
        table.add_row(r.config, str(r.batch), f"{r.corral_ms:.2f}", f"{r.reference_ms:.2f}", f"{r.speedup:.1f}×")
    console.print(table)
    results_path = write_results(
        args.out, {"vocab": args.vocab, "batches": batches, "repeats": args.repeats, "scale": args.scale},
        [r.as_dict() for r in results],
    )
    plot_pairs(args.out / "sampler.png", [f"{r.config}\nbatch {r.batch}" for r in results],
               [r.reference_ms for r in results], [r.corral_ms for r in results],
               reference_label="plain torch", corral_label="corral", xlabel="CPU ms per decode step (log)")
    console.print(f"wrote {results_path}, {args.out / 'sampler.png'}")
    return 0

