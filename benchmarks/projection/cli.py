"""`corral bench projection`: argument parsing, the table, JSON and PNG."""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.projection.runner import DEFAULT_SHAPES, DTYPES, run_projection_bench
from benchmarks.timing_report import plot_pairs, write_results


def add_projection_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "projection",
        help="CPU cost of the model's linear projections: oneDNN-packed weights against F.linear",
        description="Times server.models.projection.Projection (the weight reordered once for oneDNN, as the "
        "corral model path serves it on CPU) against F.linear (MKL) per weight shape, dtype and row count, in "
        "CPU ms of the calling thread with torch on one thread. Rows where Projection keeps F.linear (small "
        "weights, one float32 row through a short input axis) say so. Prints a table, writes "
        "OUT/results.json and OUT/projection.png.",
    )
    p.add_argument("--shapes", default=None, metavar="OUTxIN,...",
                   help="weight shapes to time, e.g. 128257x64,4096x1024 (default: the default model's head "
                   "and a Llama-3.2-1B-shaped layer)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="float32 and/or bfloat16 (default both)")
    p.add_argument("--batches", default="1,8,16", metavar="B,B", help="rows per call (default 1,8,16)")
    p.add_argument("--repeats", type=int, default=10, help="calls per timing, 3 timings each (default 10)")
    p.add_argument("--out", type=Path, default=Path("bench-out/projection"), metavar="DIR",
                   help="results folder (default bench-out/projection)")
    p.set_defaults(handler=run_projection)


def _shapes(text: str | None) -> list[tuple[str, int, int]]:
    if text is None:
        return list(DEFAULT_SHAPES)
    shapes = []
    for item in text.split(","):
        out_features, in_features = (int(n) for n in item.lower().split("x"))
        if out_features < 1 or in_features < 1:
            raise ValueError
        shapes.append((f"{out_features}x{in_features}", out_features, in_features))
    return shapes


def run_projection(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    console = Console(width=130)
    try:
        shapes = _shapes(args.shapes)
        batches = [int(b) for b in args.batches.split(",")]
        dtypes = args.dtypes.split(",")
        if not batches or min(batches) < 1 or args.repeats < 1 or not set(dtypes) <= set(DTYPES):
            raise ValueError
    except ValueError:
        console.print("[red]corral bench projection: --shapes needs OUTxIN pairs of positive integers, --batches "
                      "positive integers, --dtypes float32 and/or bfloat16, --repeats >= 1[/red]")
        return 2
    with Progress(console=console) as progress:
        task = progress.add_task("projections", total=len(shapes) * len(dtypes) * len(batches))
        results = run_projection_bench(shapes, dtypes, batches, args.repeats, lambda _: progress.advance(task))
    table = Table(title="corral bench projection (CPU ms per call, 1 thread)")
    for column in ("shape", "out x in", "dtype", "rows", "path", "corral ms", "F.linear ms", "speedup", "max |diff|"):
        table.add_column(column, justify="left" if column in ("shape", "path") else "right")
    for r in results:
        table.add_row(r.shape, f"{r.out_features}x{r.in_features}", r.dtype, str(r.rows),
                      "oneDNN" if r.packed else "F.linear", f"{r.corral_ms:.3f}", f"{r.plain_ms:.3f}",
                      f"{r.speedup:.2f}×", f"{r.max_abs_diff:.1e}")
    console.print(table)
    config = {"shapes": shapes, "dtypes": dtypes, "batches": batches, "repeats": args.repeats}
    results_path = write_results(args.out, config, [r.as_dict() for r in results])
    plot_pairs(args.out / "projection.png", [f"{r.shape} {r.dtype}\n{r.rows} rows" for r in results],
               [r.plain_ms for r in results], [r.corral_ms for r in results],
               reference_label="F.linear", corral_label="corral Projection", xlabel="CPU ms per call (log)")
    console.print(f"wrote {results_path}, {args.out / 'projection.png'}")
    return 0

