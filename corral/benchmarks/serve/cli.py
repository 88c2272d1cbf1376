"""`corral bench serve` and `corral bench peer-model`: argument parsing and the report (table, ratios)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from corral.benchmarks.harness import DATA_HELP, SERVER_HELP, Bench, bench_command, config_from_args, exit_on
from corral.benchmarks.serve.peer import PEER_HEAD_DIM
from corral.benchmarks.serve.workload import CONSTRAINT_FIELDS


def add_serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    with bench_command(
        sub, "serve", run_serve,
        help="serving load benchmark: constrained vs unconstrained at several concurrency levels",
        description="Drives a corral server over HTTP with JSONSchemaBench schemas at each concurrency level, "
        "constrained and unconstrained (same prompts, same max_tokens; unconstrained ignores EOS), and, in the "
        "same run, a naive baseline (transformers generate + xgrammar's HF logits processor, one request at a "
        "time). Writes OUT/results.json and OUT/throughput.png.",
        data=DATA_HELP, server=SERVER_HELP, server_args="extra `corral serve` flags for the server the benchmark "
        "starts, e.g. '--max-batch 32'", out="bench-out/serve", log_level=True, width=220,
    ) as p:
        p.add_argument("--schemas", type=int, default=32, metavar="N", help="schemas, spread over the subsets; "
                       "refused ones (400) are counted and replaced (default 32)")
        p.add_argument("--concurrency", default="1,4,16", metavar="LIST",
                       help="comma-separated concurrency levels (default 1,4,16)")
        p.add_argument("--max-tokens", type=int, default=64, help="max_tokens per request (default 64)")
        p.add_argument("--requests-per-level", type=int, default=None, metavar="N",
                       help="requests per (mode, concurrency) run (default: the number of schemas)")
        p.add_argument("--backend", default="auto", help="structured_outputs.backend (default auto)")
        p.add_argument("--temperature", type=float, default=0.0,
                       help="temperature of every timed request, corral's and the peer's (default 0, greedy; "
                       "OpenAI's own default is 1). The baseline stays greedy")
        p.add_argument("--top-p", type=float, default=1.0, help="top_p of every timed request (default 1, off)")
        p.add_argument("--no-baseline", dest="baseline", action="store_false",
                       help="skip the transformers generate baseline")
        p.add_argument("--kinds", default="", metavar="LIST",
                       help="constrained requests carry `corral bench kinds`' regexes, grammars or choices "
                       "(comma-separated: regex,grammar,choice) instead of JSONSchemaBench schemas, to corral "
                       "and to a peer in structured_outputs; needs --no-baseline")
        peer = p.add_argument_group("peer", "drive another OpenAI-compatible server (vLLM, SGLang, ...) with the "
                                    "same requests in the same run, one side after the other; see "
                                    "docs/serving-benchmark.md")
        peer.add_argument("--peer-url", default=None, metavar="URL",
                          help="a running peer server, e.g. http://127.0.0.1:8001 (default: no peer)")
        peer.add_argument("--peer-model", default=None, metavar="NAME",
                          help="the peer's model name (default: the first id its /v1/models lists)")
        peer.add_argument("--peer-constraint", choices=CONSTRAINT_FIELDS, default="structured_outputs",
                          help="how constrained requests ask the peer for the schema: structured_outputs: {json: "
                          "schema} (current vLLM), guided_json: schema (older vLLM; 0.32 silently ignores it), "
                          "OpenAI's response_format json_schema, json_schema: schema (llama.cpp's llama-server), or "
                          "grammar: a --kinds regex written as GBNF (llama-server) (default structured_outputs)")
        peer.add_argument("--peer-api-key", default=None, metavar="KEY", help="bearer token for the peer")


def add_peer_model_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    with bench_command(
        sub, "peer-model", run_peer_model,
        help="write the default model re-laid out to head_dim 32, for vLLM-cpu as a `bench serve` peer",
        description="Writes an exact re-layout of a Llama checkpoint (default: the tiny model, corral-tiny) with "
        "wider attention heads: q/k/v heads zero-padded, rope_theta raised and q rescaled so the function is "
        "unchanged (transformers gives the same logits within float error). vLLM-cpu refuses head_dim 16.",
        width=80,
    ) as p:
        p.add_argument("--out", type=Path, required=True, metavar="DIR", help="where to write the checkpoint")
        p.add_argument("--model", type=Path, default=None, metavar="DIR",
                       help="the Llama checkpoint to re-lay out (default: the tiny model, corral-tiny)")
        p.add_argument("--head-dim", type=int, default=PEER_HEAD_DIM,
                       help=f"new head_dim (default {PEER_HEAD_DIM})")


def run_peer_model(args: argparse.Namespace, bench: Bench) -> int:
    from corral.benchmarks.serve.peer_model import write_peer_model

    source = args.model
    if source is None:
        from corral.server.models.default_model import ensure_default_model

        source = ensure_default_model()
    with exit_on((ValueError, OSError), 2):
        out = write_peer_model(source, args.out, args.head_dim)
    bench.console.print(f"wrote {out} (from {source}, head_dim {args.head_dim})")
    return 0


def parse_levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise ValueError(f"--concurrency must be integers separated by commas, got {text!r}") from exc
    if not levels:
        raise ValueError("--concurrency needs at least one level")
    return levels


def run_serve(args: argparse.Namespace, bench: Bench) -> int:
    from corral.benchmarks.serve.runner import ServeBenchConfig, run_serve_bench

    with exit_on(ValueError, 2):
        kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
        config = config_from_args(ServeBenchConfig, args, concurrency=parse_levels(args.concurrency), kinds=kinds)
    with exit_on(RuntimeError, 1), bench.progress() as progress:
        results = run_serve_bench(config, progress)
    _print_report(bench, results)
    return 0


def _print_report(bench: Bench, results: dict[str, Any]) -> None:
    from corral.benchmarks.serve.bandwidth import bandwidth_line
    from corral.benchmarks.serve.report import COLUMNS, ratio_lines, table_rows

    peer = results.get("peer")
    bench.table("corral bench serve", [header for _, header, _ in COLUMNS],
                table_rows(results["runs"], results["baseline"], peer["runs"] if peer else ()),
                left=("mode", "finish"))
    for line in ratio_lines(results["ratios"]):
        bench.console.print(line)
    bench.console.print(bandwidth_line(results["bandwidth"]))
    memory = results.get("memory") or {}
    sides = [f"{side} {m['pss_mb'] / 1024:.2f} GB" for side in ("corral", "peer") if (m := memory.get(side))]
    if sides:
        bench.console.print("memory (PSS over each server's processes, after the runs): " + ", ".join(sides))
    schemas = results["schemas"]
    bench.console.print(f"schemas used {len(schemas['used'])} of {schemas['requested']} requested; refused (400) "
                        f"{len(schemas['refused'])}; other errors {len(schemas['errors'])}")
    if peer:
        bench.console.print(f"peer {peer['model']} at {peer['url']} ({peer['constraint']}): refused (400) "
                            f"{len(peer['refused'])}, other errors {len(peer['errors'])} of corral's schemas "
                            "(dropped from both sides' timed runs)")
    bench.wrote(*results["files"], wall_s=results["wall_s"])
