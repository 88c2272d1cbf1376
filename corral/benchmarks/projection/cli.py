"""`corral bench projection`: argument parsing, the table, JSON and PNG."""

from __future__ import annotations

import argparse

from corral.benchmarks.harness import Bench, BenchExit, bench_command
from corral.benchmarks.timing_report import report_pairs


def add_projection_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    with bench_command(
        sub, "projection", run_projection,
        help="CPU cost of the model's linear projections: oneDNN-packed weights against F.linear",
        description="Times corral.kernels.projection.Projection (the weight reordered once for oneDNN, as the "
        "corral model path serves it on CPU) against F.linear (MKL) per weight shape, dtype and row count, in "
        "CPU ms of the calling thread with torch on one thread. Rows where Projection keeps F.linear (small "
        "weights, one float32 row through a short input axis) say so. Prints a table, writes "
        "OUT/results.json and OUT/projection.png.",
        out="bench-out/projection", width=130,
    ) as p:
        p.add_argument("--shapes", default=None, metavar="OUTxIN,...",
                       help="weight shapes to time, e.g. 128257x64,4096x1024 (default: the default model's head "
                       "and a Llama-3.2-1B-shaped layer)")
        p.add_argument("--dtypes", default="float32,bfloat16", help="float32 and/or bfloat16 (default both)")
        p.add_argument("--batches", default="1,8,16", metavar="B,B", help="rows per call (default 1,8,16)")
        p.add_argument("--repeats", type=int, default=10, help="calls per timing, 3 timings each (default 10)")


def _shapes(text: str | None) -> list[tuple[str, int, int]]:
    from corral.benchmarks.projection.runner import DEFAULT_SHAPES

    if text is None:
        return list(DEFAULT_SHAPES)
    shapes = []
    for item in text.split(","):
        out_features, in_features = (int(n) for n in item.lower().split("x"))
        if out_features < 1 or in_features < 1:
            raise ValueError
        shapes.append((f"{out_features}x{in_features}", out_features, in_features))
    return shapes


def run_projection(args: argparse.Namespace, bench: Bench) -> int:
    from corral.benchmarks.projection.runner import DTYPES, run_projection_bench

    try:
        shapes = _shapes(args.shapes)
        batches = [int(b) for b in args.batches.split(",")]
        dtypes = args.dtypes.split(",")
        if not batches or min(batches) < 1 or args.repeats < 1 or not set(dtypes) <= set(DTYPES):
            raise ValueError
    except ValueError:
        raise BenchExit("--shapes needs OUTxIN pairs of positive integers, --batches positive integers, --dtypes "
                        "float32 and/or bfloat16, --repeats >= 1") from None

    with bench.progress() as progress:
        progress.phase("projections", len(shapes) * len(dtypes) * len(batches))
        results = run_projection_bench(shapes, dtypes, batches, args.repeats, lambda _: progress.advance())
    bench.table("corral bench projection (CPU ms per call, 1 thread)",
                ["shape", "out x in", "dtype", "rows", "path", "corral ms", "F.linear ms", "speedup", "max |diff|"],
                [[r.shape, f"{r.out_features}x{r.in_features}", r.dtype, str(r.rows),
                  "oneDNN" if r.packed else "F.linear", f"{r.corral_ms:.3f}", f"{r.plain_ms:.3f}", f"{r.speedup:.2f}×",
                  f"{r.max_abs_diff:.1e}"] for r in results], left=("shape", "path"))
    config = {"shapes": shapes, "dtypes": dtypes, "batches": batches, "repeats": args.repeats}
    return report_pairs(bench, config, [r.as_dict() for r in results],
                        [f"{r.shape} {r.dtype}\n{r.rows} rows" for r in results], [r.plain_ms for r in results],
                        [r.corral_ms for r in results], reference_label="F.linear", corral_label="corral Projection",
                        xlabel="CPU ms per call (log)")
