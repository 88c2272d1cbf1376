"""`corral bench mediation`: argument parsing and the console report."""

from __future__ import annotations

import argparse
from typing import Any

from corral.benchmarks.harness import DATA_HELP, Bench, bench_command, config_from_args, exit_on

MODES = ("schema_constrained", "json_mode", "contract_only")


def add_mediation_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    with bench_command(
        sub, "mediation", run_mediation,
        help="mediation per mode: success rate, attempts, tokens per success, failure classes",
        description="Mediates each of N JSONSchemaBench schemas (with a semantic rule derived from it) through "
        "mediation.Mediator in every mode against a corral it starts (or --server URL). Writes OUT/results.json.",
        data=DATA_HELP, server="a running corral (default: start one)", server_args="extra `corral serve` flags",
        out="bench-out/mediation", log_level=True, needs=("openai",),
    ) as p:
        p.add_argument("--schemas", type=int, default=200, metavar="N", help="schemas (default 200)")
        p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated (default {','.join(MODES)})")
        p.add_argument("--markers", action="store_true", help="require the BEGIN/END_DISPATCH_RESULT block")
        p.add_argument("--max-attempts", type=int, default=3, help="RepairPolicy.max_attempts (default 3)")
        p.add_argument("--concurrency", type=int, default=4, help="mediated calls in flight (default 4)")
        p.add_argument("--max-tokens", type=int, default=512, help="max_tokens per round (default 512)")
        p.add_argument("--model", default=None, metavar="NAME", help="the `model` field (default: the server's)")


def run_mediation(args: argparse.Namespace, bench: Bench) -> int:
    from corral.benchmarks.mediation.runner import MediationBenchConfig, run_mediation_bench

    with exit_on(ValueError, 2):
        config = config_from_args(MediationBenchConfig, args,
                                  modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()))
    with exit_on(RuntimeError, 1), bench.progress() as progress:
        progress.phase("mediation", config.schemas * len(config.modes))
        report = run_mediation_bench(config, lambda r: progress.advance(
            f"{r.mode} {r.case_id[:28]}: {'ok' if r.ok else r.failure_class}"))
    _print_report(bench, report)
    return 0


def _print_report(bench: Bench, report: dict[str, Any]) -> None:
    bench.console.print(f"{report['schemas']} schemas, {report['declared']} declared by corral")
    columns = ["mode", "calls", "success", "within 2", "mean attempts", "tokens/success", "terminal failures"]
    for title, key in (("all schemas", "summary"), ("schemas corral declares", "summary_declared")):
        rows = [[mode, str(s["calls"]), f"{s['success']} ({s['success_rate']:.1%})" if s["calls"] else "-",
                 str(s["success_within_2"]), str(s["mean_attempts"]), str(s["tokens_per_success"]),
                 ", ".join(f"{k} {v}" for k, v in s["terminal_failures"].items()) or "-"]
                for mode, s in report[key].items()]
        bench.table(f"corral bench mediation: {title}", columns, rows, left=("mode", "terminal failures"))
    bench.wrote(*report["files"], wall_s=report["wall_s"])
