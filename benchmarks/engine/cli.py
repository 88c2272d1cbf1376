"""`corral bench engine`: argument parsing, the table, JSON and PNG."""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.timing_report import plot_pairs, write_results

MODES = ("constrained", "unconstrained")


def add_engine_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "engine",
        help="the decode loop alone (no HTTP): ms per step and tok/s, constrained and free text",
        description="Drives Engine.step() directly with `bench serve`'s JSONSchemaBench requests kept at each "
        "concurrency level (greedy; constrained under `auto` with the contract guard, as the server builds "
        "them; unconstrained ignoring EOS). Reports wall and engine-thread CPU ms per step and tok/s: the "
        "engine's own speed without the HTTP client and event loop beside it. Prints a table, writes "
        "OUT/results.json and OUT/engine.png.",
    )
    p.add_argument("--data", type=Path, required=True, metavar="DIR", help="JSONSchemaBench root with "
                   "<Subset>/*.json")
    p.add_argument("--schemas", type=int, default=32, metavar="N", help="schemas to use (refused ones are "
                   "replaced; default 32)")
    p.add_argument("--concurrency", default="1,8", metavar="LIST", help="comma-separated levels (default 1,8)")
    p.add_argument("--requests", type=int, default=200, metavar="N", help="requests per mode and level "
                   "(default 200)")
    p.add_argument("--max-tokens", type=int, default=64, metavar="N", help="max_tokens per request (default 64)")
    p.add_argument("--modes", default=",".join(MODES), help="constrained and/or unconstrained (default both)")
    p.add_argument("--out", type=Path, default=Path("bench-out/engine"), metavar="DIR",
                   help="results folder (default bench-out/engine)")
    p.set_defaults(handler=run_engine)


def run_engine(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress, TaskID
    from rich.table import Table

    console = Console(width=130)
    try:
        levels = [int(c) for c in args.concurrency.split(",")]
        modes = args.modes.split(",")
        if not levels or min(levels) < 1 or args.requests < 1 or args.max_tokens < 1 or args.schemas < 1:
            raise ValueError
        if not modes or not set(modes) <= set(MODES):
            raise ValueError
    except ValueError:
        console.print("[red]corral bench engine: --concurrency needs positive integers, --modes constrained "
                      "and/or unconstrained, --requests, --max-tokens and --schemas >= 1[/red]")
        return 2
    import torch

    from benchmarks.engine.runner import new_engine, prepare, run_level
    from benchmarks.serve.workload import candidate_cases
    from samplers.compilation import GrammarCache
    from samplers.protocol import TokenizerSpec
    from samplers.registry import BackendSet
    from server.models import load_model
    from server.settings import default_cpu_threads

    try:
        cases = candidate_cases(args.data, args.schemas)
    except (OSError, ValueError) as exc:
        console.print(f"[red]corral bench engine: {exc}[/red]")
        return 2
    loaded = load_model("corral-tiny")
    if loaded.device.type == "cpu":  # as `corral serve` runs its engine thread: one core left for the rest
        torch.set_num_threads(default_cpu_threads())
    grammars = GrammarCache(BackendSet(TokenizerSpec(loaded.tokenizer, loaded.vocab_size, loaded.stop_token_ids)))
    engine = new_engine(loaded, max(levels))
    results = []
    with Progress(console=console) as progress:
        task = progress.add_task("compile schemas", total=args.schemas)
        work = prepare(loaded, grammars, cases, args.schemas, lambda _: progress.advance(task))
        if not work:
            console.print("[red]corral bench engine: no schema compiled[/red]")
            return 1
        # Untimed: the first steps pay one-off costs (kernel selection, first matchers).
        run_level(engine, grammars, work, mode=modes[0], concurrency=max(levels), requests=max(levels),
                  max_tokens=args.max_tokens, on_done=lambda: None)
        for mode in modes:
            for level in levels:
                level_task = progress.add_task(f"{mode} @ {level}", total=args.requests)

                def advance(level_task: TaskID = level_task) -> None:
                    progress.advance(level_task)

                results.append(run_level(engine, grammars, work, mode=mode, concurrency=level,
                                         requests=args.requests, max_tokens=args.max_tokens, on_done=advance))
    table = Table(title=f"corral bench engine ({loaded.device}, {len(work)} schemas, no HTTP)")
    for column in ("mode", "conc", "requests", "tokens", "steps", "wall ms/step", "CPU ms/step", "tok/s",
                   "valid/finished"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for r in results:
        table.add_row(r.mode, str(r.concurrency), str(r.requests), str(r.tokens), str(r.steps),
                      f"{r.wall_ms_per_step:.2f}", f"{r.cpu_ms_per_step:.2f}", f"{r.tokens_per_s:.1f}",
                      f"{r.valid}/{r.finished}" if r.mode == "constrained" else "–")
    console.print(table)
    config = {"data": str(args.data), "schemas": len(work), "concurrency": levels, "requests": args.requests,
              "max_tokens": args.max_tokens, "modes": modes, "device": str(loaded.device)}
    results_path = write_results(args.out, config, [r.as_dict() for r in results])
    plot_pairs(args.out / "engine.png", [f"{r.mode} @ {r.concurrency}" for r in results],
               [r.wall_ms_per_step for r in results], [r.cpu_ms_per_step for r in results],
               reference_label="wall ms per step", corral_label="engine-thread CPU ms per step",
               xlabel="ms per step (log)")
    console.print(f"wrote {results_path}, {args.out / 'engine.png'}")
    return 0
