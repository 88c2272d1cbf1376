"""`corral bench prefix`: argument parsing, the table, JSON and PNG."""

from __future__ import annotations

import argparse

from corral.benchmarks.harness import Bench, BenchExit, bench_command
from corral.benchmarks.timing_report import report_pairs


def add_prefix_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    with bench_command(
        sub, "prefix", run_prefix,
        help="time to first token with the prefix cache on and off: a repeated system prompt, n samples, prompts "
        "that return after more others than there are slots",
        description="Runs the engine itself (no HTTP) with the prefix cache on and off, alternating, on a long "
        "system prompt: the TTFT of a first request (cold) and of a second one sharing its system prompt, "
        "n samples of one prompt submitted together (until the last one's first token, until all end), and "
        "4 long prompts on 2 slots sent twice over (the second round's TTFT, with the host block store and "
        "with the slots alone). "
        "Prints medians over --repeats, writes OUT/results.json and OUT/prefix.png.",
        out="bench-out/prefix", width=130,
    ) as p:
        p.add_argument("--model", default="corral-tiny", metavar="NAME|DIR",
                       help="a built-in model name or a model folder (default: corral-tiny)")
        p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
        p.add_argument("--dtype", default=None, help="model dtype (default: the server's default for the device)")
        p.add_argument("--prompt-tokens", type=int, default=2000, metavar="N",
                       help="system prompt length in tokens (default 2000)")
        p.add_argument("--samples", type=int, default=4, metavar="N",
                       help="n of the n-samples scenario (default 4)")
        p.add_argument("--max-tokens", type=int, default=16, metavar="N", help="tokens generated per request "
                       "(default 16)")
        p.add_argument("--repeats", type=int, default=3, metavar="N", help="runs of each scenario per setting; "
                       "medians are reported (default 3)")


def run_prefix(args: argparse.Namespace, bench: Bench) -> int:
    if args.prompt_tokens < 32 or args.samples < 2 or args.max_tokens < 1 or args.repeats < 1:
        raise BenchExit("--prompt-tokens >= 32, --samples >= 2, --max-tokens >= 1 and --repeats >= 1")
    import torch

    from corral.benchmarks.prefix.runner import run_prefix_bench
    from corral.server.models import load_model
    from corral.server.settings import default_cpu_threads

    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    if loaded.device.type == "cpu":  # as `corral serve` runs its engine thread: one core left for the rest
        torch.set_num_threads(default_cpu_threads())
    with bench.progress() as progress:
        progress.phase("repeats (cache on, then off)", args.repeats)
        results = run_prefix_bench(loaded, args.prompt_tokens, args.samples, args.max_tokens, args.repeats,
                                   lambda _: progress.advance())
    bench.table(f"corral bench prefix ({loaded.device}, {args.prompt_tokens}-token system prompt, median of "
                f"{args.repeats})", ["scenario", "cache on ms", "cache off ms", "speedup", "tokens from cache"],
                [[r.scenario, f"{r.cached_ms:.1f}", f"{r.plain_ms:.1f}", f"{r.speedup:.2f}×", str(r.hit_tokens)]
                 for r in results])
    config = {"model": str(args.model or "default"), "device": str(loaded.device), "prompt_tokens": args.prompt_tokens,
              "samples": args.samples, "max_tokens": args.max_tokens, "repeats": args.repeats}
    return report_pairs(bench, config, [r.as_dict() for r in results], [r.scenario for r in results],
                        [r.plain_ms for r in results], [r.cached_ms for r in results],
                        reference_label="prefix cache off", corral_label="prefix cache on", xlabel="wall ms (log)")
