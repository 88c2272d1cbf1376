"""`corral bench kinds`: argument parsing, the table, JSON and PNG."""

from __future__ import annotations

import argparse
import time

from corral.benchmarks.harness import Bench, BenchExit, bench_command, exit_on
from corral.benchmarks.timing_report import plot_pairs

DEFAULT_BACKENDS = "xgrammar,llguidance"


def add_kinds_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    with bench_command(
        sub, "kinds", run_kinds_command,
        help="per-token mask cost of each backend on regexes, grammars and choices, narrow and wide",
        description="Compiles each built-in case (corral/benchmarks/kinds/cases.py) with every backend and "
        "teacher-forces "
        "one answer through fresh matchers, round after round, backends alternating: the mean fill_bitmask "
        "per token (median over rounds, the first round apart as `cold`), accept + jump-forward per token, "
        "and one batched fill of --batch rows per step, as the engine fills a step. The `auto` column is the "
        "backend `auto` tries first. Prints a table, writes OUT/results.json and OUT/kinds.png.",
        out="bench-out/kinds", width=170,
    ) as p:
        p.add_argument("--model", default="corral-tiny", help="whose tokenizer (default corral-tiny; "
                       "gemma-3-270m is the real model's)")
        p.add_argument("--backends", default=DEFAULT_BACKENDS, help=f"comma-separated (default {DEFAULT_BACKENDS})")
        p.add_argument("--rounds", type=int, default=7, help="matchers per case and backend (default 7)")
        p.add_argument("--batch", type=int, default=8, help="rows of the batched fill (default 8)")
        p.add_argument("--walk-tokens", type=int, default=48, help="longest random walk (default 48)")
        p.add_argument("--cases", default="", metavar="TEXT", help="only cases whose label contains TEXT")


def _us(value: float | None) -> str:
    return "–" if value is None else f"{value:,.1f}"


def run_kinds_command(args: argparse.Namespace, bench: Bench) -> int:
    names = [n for n in args.backends.split(",") if n]
    if not names or args.rounds < 2 or args.batch < 1 or args.walk_tokens < 1:
        raise BenchExit("--backends needs at least one name, --rounds >= 2, --batch and --walk-tokens >= 1")
    from corral.benchmarks.kinds.cases import CASES
    from corral.benchmarks.kinds.runner import KindResult, routed_first, run_kinds
    from corral.grammar_engines.protocol import TokenizerSpec
    from corral.grammar_engines.registry import BackendSet, UnknownBackend
    from corral.server.models import load_model

    cases = [c for c in CASES if args.cases in c.label]
    if not cases:
        raise BenchExit(f"no case label contains {args.cases!r}")
    with exit_on(Exception, 2):
        loaded = load_model(args.model, device="cpu")
    with exit_on(UnknownBackend, 2):
        backends = BackendSet(TokenizerSpec(loaded.tokenizer, loaded.vocab_size, loaded.stop_token_ids), names)
        for name in names:
            backends.check_name(name)
    started = time.perf_counter()
    with bench.progress() as progress:
        progress.phase("cases", len(cases))
        results = run_kinds(backends, cases, args.rounds, args.batch, args.walk_tokens,
                            lambda c: progress.advance(c.label))
    by_case: dict[str, dict[str, KindResult]] = {}
    for r in results:
        by_case.setdefault(r.case, {})[r.backend] = r
    columns = ["case", "kind", "tokens"]
    for name in names:  # short headers (xgr, llg): the table is wide
        short = name[:3]
        columns += [f"{short} compile ms", f"{short} cold µs", f"{short} µs/token", f"{short} walk µs",
                    f"{short} after µs", f"{short} ×{args.batch} µs/step"]
    columns += ["fastest", "auto"]
    rows = []
    for case in cases:
        row = by_case[case.label]
        first = next(iter(row.values()))
        cells = [case.label, case.kind, str(first.tokens)]
        for name in names:
            r = row[name]
            cells += ([_us(r.compile_ms), _us(r.cold_fill_us), _us(r.fill_us), _us(r.walk_us), _us(r.after_us),
                       _us(r.batch_step_us)] if r.error is None else ["refused", "–", "–", "–", "–", "–"])
        timed = [r for r in row.values() if r.fill_us is not None]
        cells += [min(timed, key=lambda r: r.fill_us or 0.0).backend if timed else "–", routed_first(backends, case)]
        rows.append(cells)
    bench.table(f"corral bench kinds ({args.model} tokenizer, {loaded.vocab_size:,} logits; median of "
                f"{args.rounds - 1} warm rounds)", columns, rows, left={"case", "kind", "fastest", "auto"})
    for r in results:
        if r.error is not None:
            bench.console.print(f"{r.case} / {r.backend}: {r.error}")
    sources = {c.label: {"kind": c.kind, "source": c.spec.source, "text": c.text} for c in cases}
    config = {"model": args.model, "vocab": loaded.vocab_size, "backends": names, "rounds": args.rounds,
              "batch": args.batch, "walk_tokens": args.walk_tokens, "cases": sources}
    written = bench.write_results(config, [{**r.as_dict(), "auto": routed_first(backends, c)}
                                           for c in cases for r in by_case[c.label].values()])
    if len(names) == 2:  # one pair of bars a case: µs per token of each backend
        def fills(name: str) -> list[float]:  # a refused case has no bar
            return [by_case[c.label][name].fill_us or float("nan") for c in cases]

        plot_pairs(bench.plot_path, [c.label for c in cases], fills(names[0]), fills(names[1]),
                   reference_label=names[0], corral_label=names[1], xlabel="mask fill µs per token (log)")
        bench.wrote(written, bench.plot_path, wall_s=time.perf_counter() - started)
    else:
        bench.wrote(written, wall_s=time.perf_counter() - started)
    return 0
