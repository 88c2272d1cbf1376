"""`corral bench sampler`: argument parsing, the table, JSON and PNG."""

from __future__ import annotations

import argparse

from corral.benchmarks.harness import Bench, BenchExit, bench_command
from corral.benchmarks.timing_report import report_pairs

DEFAULT_VOCAB = 128_257  # the tiny model's (corral-tiny) (Llama 3 tokenizer)


def add_sampler_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    with bench_command(
        sub, "sampler", run_sampler,
        help="CPU cost of the sampling step (argmax, draws, top-k/top-p/min-p) against plain torch",
        description="Times corral's sample_rows against the plain torch step (torch.argmax; torch.multinomial "
        "over the softmax; a full descending sort for the filters) on random logits, per sampling "
        "configuration and batch size, in CPU ms of the calling thread with torch on one thread. Prints a "
        "table, writes OUT/results.json and OUT/sampler.png.",
        out="bench-out/sampler", width=120,
    ) as p:
        p.add_argument("--vocab", type=int, default=DEFAULT_VOCAB, help=f"logits per row (default {DEFAULT_VOCAB})")
        p.add_argument("--batches", default="1,8", metavar="B,B", help="batch sizes (default 1,8)")
        p.add_argument("--repeats", type=int, default=10, help="steps per timing, 3 timings each (default 10)")
        p.add_argument("--scale", type=float, default=4.0,
                       help="logits are standard normal × this; larger is more peaked (default 4)")


def run_sampler(args: argparse.Namespace, bench: Bench) -> int:
    try:
        batches = [int(b) for b in args.batches.split(",")]
        if not batches or min(batches) < 1 or args.vocab < 2 or args.repeats < 1:
            raise ValueError
    except ValueError:
        raise BenchExit("--batches needs positive integers, --vocab >= 2, --repeats >= 1") from None
    from corral.benchmarks.sampler.runner import CONFIGS, run_sampler_bench

    with bench.progress() as progress:
        progress.phase("sampling configurations", len(CONFIGS) * len(batches))
        results = run_sampler_bench(args.vocab, batches, args.repeats, args.scale, lambda _: progress.advance())
    bench.table(f"corral bench sampler (vocab {args.vocab}, CPU ms per step, 1 thread)",
                ["configuration", "batch", "corral ms", "plain torch ms", "speedup"],
                [[r.config, str(r.batch), f"{r.corral_ms:.2f}", f"{r.reference_ms:.2f}", f"{r.speedup:.1f}×"]
                 for r in results])
    config = {"vocab": args.vocab, "batches": batches, "repeats": args.repeats, "scale": args.scale}
    return report_pairs(bench, config, [r.as_dict() for r in results],
                        [f"{r.config}\nbatch {r.batch}" for r in results], [r.reference_ms for r in results],
                        [r.corral_ms for r in results], reference_label="plain torch", corral_label="corral",
                        xlabel="CPU ms per decode step (log)")
