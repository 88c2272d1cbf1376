"""`corral bench engine`: argument parsing, the table, JSON and PNG."""

from __future__ import annotations

import argparse

from corral.benchmarks.harness import DATA_HELP, Bench, BenchExit, bench_command, exit_on
from corral.benchmarks.timing_report import report_pairs

MODES = ("constrained", "unconstrained")


def add_engine_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    with bench_command(
        sub, "engine", run_engine,
        help="the decode loop alone (no HTTP): ms per step and tok/s, constrained and free text",
        description="Drives Engine.step() directly with `bench serve`'s JSONSchemaBench requests kept at each "
        "concurrency level (greedy; constrained under `auto` with the contract guard, as the server builds "
        "them; unconstrained ignoring EOS). Reports wall and engine-thread CPU ms per step and tok/s: the "
        "engine's own speed without the HTTP client and event loop beside it. Prints a table, writes "
        "OUT/results.json and OUT/engine.png.",
        data=DATA_HELP, out="bench-out/engine", width=130,
    ) as p:
        p.add_argument("--schemas", type=int, default=32, metavar="N", help="schemas to use (refused ones are "
                       "replaced; default 32)")
        p.add_argument("--concurrency", default="1,8", metavar="LIST", help="comma-separated levels (default 1,8)")
        p.add_argument("--requests", type=int, default=200, metavar="N", help="requests per mode and level "
                       "(default 200)")
        p.add_argument("--max-tokens", type=int, default=64, metavar="N",
                       help="max_tokens per request (default 64)")
        p.add_argument("--modes", default=",".join(MODES), help="constrained and/or unconstrained (default both)")
        p.add_argument("--model", default="corral-tiny", metavar="NAME",
                       help="a built-in model, checkpoint directory or .gguf, loaded with the server's defaults "
                       "(default corral-tiny, the tiny random model)")


def run_engine(args: argparse.Namespace, bench: Bench) -> int:
    try:
        levels = [int(c) for c in args.concurrency.split(",")]
        modes = args.modes.split(",")
        if not levels or min(levels) < 1 or args.requests < 1 or args.max_tokens < 1 or args.schemas < 1:
            raise ValueError
        if not modes or not set(modes) <= set(MODES):
            raise ValueError
    except ValueError:
        raise BenchExit("--concurrency needs positive integers, --modes constrained and/or unconstrained, "
                        "--requests, --max-tokens and --schemas >= 1") from None
    import torch

    from corral.benchmarks.engine.runner import new_engine, prepare, run_level
    from corral.benchmarks.serve.workload import candidate_cases
    from corral.grammar_engines.compilation import GrammarCache
    from corral.grammar_engines.protocol import TokenizerSpec
    from corral.grammar_engines.registry import BackendSet
    from corral.server.models import load_model
    from corral.server.models.checkpoint_meta import ModelLoadError
    from corral.server.settings import cpu_thread_choices, default_cpu_threads

    with exit_on((OSError, ValueError), 2):
        cases = candidate_cases(args.data, args.schemas)
    with exit_on((ModelLoadError,), 2):
        loaded = load_model(args.model)
    choices: tuple[int, ...] = ()
    if loaded.device.type == "cpu":  # as `corral serve` runs its engine thread: one core left for the rest
        torch.set_num_threads(default_cpu_threads())
        choices = cpu_thread_choices()  # and each forward on the count measured best for it
    grammars = GrammarCache(BackendSet(TokenizerSpec(loaded.tokenizer, loaded.vocab_size, loaded.stop_token_ids)))
    engine = new_engine(loaded, max(levels), choices)
    results = []
    with bench.progress() as progress:
        progress.phase("compile schemas", args.schemas)
        work = prepare(loaded, grammars, cases, args.schemas, lambda _: progress.advance())
        if not work:
            raise BenchExit("no schema compiled", 1)
        # Untimed: the first steps pay one-off costs (kernel selection, first matchers).
        run_level(engine, grammars, work, mode=modes[0], concurrency=max(levels), requests=max(levels),
                  max_tokens=args.max_tokens, on_done=lambda: None)
        for mode in modes:
            for level in levels:
                progress.phase(f"{mode} @ {level}", args.requests)
                results.append(run_level(engine, grammars, work, mode=mode, concurrency=level,
                                         requests=args.requests, max_tokens=args.max_tokens, on_done=progress.advance))
    bench.table(f"corral bench engine ({loaded.name}, {loaded.device}, {len(work)} schemas, no HTTP)",
                ["mode", "conc", "requests", "tokens", "steps", "wall ms/step", "CPU ms/step", "tok/s",
                 "valid/finished"],
                [[r.mode, str(r.concurrency), str(r.requests), str(r.tokens), str(r.steps), f"{r.wall_ms_per_step:.2f}",
                  f"{r.cpu_ms_per_step:.2f}", f"{r.tokens_per_s:.1f}",
                  f"{r.valid}/{r.finished}" if r.mode == "constrained" else "–"] for r in results])
    config = {"data": str(args.data), "schemas": len(work), "concurrency": levels, "requests": args.requests,
              "max_tokens": args.max_tokens, "modes": modes, "device": str(loaded.device)}
    return report_pairs(
        bench, config, [r.as_dict() for r in results], [f"{r.mode} @ {r.concurrency}" for r in results],
        [r.wall_ms_per_step for r in results], [r.cpu_ms_per_step for r in results],
        reference_label="wall ms per step", corral_label="engine-thread CPU ms per step", xlabel="ms per step (log)")
