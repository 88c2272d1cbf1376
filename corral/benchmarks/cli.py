"""`corral bench ...`: the benchmark subcommands (jsonschemabench, serve, peer-model, tools, sampler, projection,
prefix, engine, mediation, startup, fuzz, soak, quality, kinds, paired, agree, drafts, gpu), each from its package's
cli.py on corral.benchmarks.harness.

corral/server/cli.py imports this module only for `corral bench`; building these parsers loads no benchmark package
(rich, matplotlib, httpx, torch): each command imports what it needs when it runs."""

from __future__ import annotations

import argparse

from corral.benchmarks.drafts.cli import add_drafts_parser
from corral.benchmarks.engine.cli import add_engine_parser
from corral.benchmarks.fuzz.cli import add_fuzz_parser
from corral.benchmarks.gpu.cli import add_gpu_parser
from corral.benchmarks.jsonschemabench.cli import add_jsonschemabench_parser
from corral.benchmarks.kinds.cli import add_kinds_parser
from corral.benchmarks.mediation.cli import add_mediation_parser
from corral.benchmarks.prefix.cli import add_prefix_parser
from corral.benchmarks.projection.cli import add_projection_parser
from corral.benchmarks.quality.cli import add_quality_parser
from corral.benchmarks.sampler.cli import add_sampler_parser
from corral.benchmarks.serve.cli import add_peer_model_parser, add_serve_parser
from corral.benchmarks.serve.greedy_agreement import add_agree_parser
from corral.benchmarks.serve.paired import add_paired_parser
from corral.benchmarks.soak.cli import add_soak_parser
from corral.benchmarks.startup.cli import add_startup_parser
from corral.benchmarks.tools.cli import add_tools_parser

BENCH_HELP = "run a benchmark"  # corral/server/cli.py lists `bench` with the same words before it loads this module


def add_bench_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = sub.add_parser("bench", help=BENCH_HELP, description="Benchmarks of corral's grammar backends.")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for add in (add_jsonschemabench_parser, add_serve_parser, add_peer_model_parser, add_tools_parser,
                add_sampler_parser, add_projection_parser, add_prefix_parser, add_engine_parser,
                add_mediation_parser, add_startup_parser, add_fuzz_parser, add_soak_parser, add_quality_parser,
                add_kinds_parser, add_paired_parser, add_agree_parser, add_drafts_parser, add_gpu_parser):
        add(bench_sub)
