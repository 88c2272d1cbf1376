"""`corral bench drafts`: argument parsing, the table, JSON and PNG."""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from corral.benchmarks.harness import Bench, BenchExit, bench_command, pyplot, save_figure

DRAFTS_ON, DRAFTS_OFF, PEER = "corral drafts", "corral no drafts", "peer"


def add_drafts_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    with bench_command(
        sub, "drafts", run_drafts,
        help="speculative decoding: extraction answers per second with drafts on and off, and a peer's",
        description="Sends JSON extraction requests whose answers copy from an e-mail-sized text (greedy, "
        "response_format json_schema) to corral with drafts on and off (the request's `drafts` field) and, "
        "with --peer-url, to another server, the sides taking turns within each repeat. Prints answers and "
        "tokens per second, exact answers, the draft acceptance and the ratios (medians of each repeat's "
        "ratio), writes OUT/results.json and OUT/drafts.png.",
        server="a running corral (default: start one as a subprocess with --server-args and stop it at the end)",
        server_args="`corral serve` flags for the server the benchmark starts",
        server_args_default="--model qwen2.5-coder-1.5b-instruct", out="bench-out/drafts", width=200,
    ) as p:
        p.add_argument("--task", choices=["extract", "free", "plain"], default="extract",
                       help="extract: the order as JSON under its schema; free: a reply in words quoting the "
                       "order, no schema; plain: a short text on a topic that copies nothing, ignoring EOS so "
                       "every answer is --max-tokens long (default extract)")
        p.add_argument("--items", type=int, default=8, metavar="N", help="extraction requests per pass (default 8)")
        p.add_argument("--concurrency", default="1", metavar="LIST", help="comma-separated levels (default 1)")
        p.add_argument("--max-tokens", type=int, default=256, metavar="N", help="max_tokens (default 256)")
        p.add_argument("--repeats", type=int, default=2, metavar="N", help="passes per side and level (default 2)")
        p.add_argument("--peer-url", default=None, metavar="URL", help="a running peer, e.g. llama-server")
        p.add_argument("--peer-model", default=None, metavar="NAME", help="the peer's model name (default: the "
                       "first its /v1/models lists)")
        p.add_argument("--peer-constraint", choices=["response_format", "json_schema"], default="response_format",
                       help="how the peer is asked for the schema: OpenAI's response_format, or llama-server's "
                       "json_schema field (default response_format)")


def run_drafts(args: argparse.Namespace, bench: Bench) -> int:
    try:
        levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    except ValueError as exc:
        raise BenchExit(f"--concurrency takes comma-separated integers: {exc}") from exc
    if args.items < 1 or args.repeats < 1 or args.max_tokens < 16 or not levels or min(levels) < 1:
        raise BenchExit("--items >= 1, --repeats >= 1, --max-tokens >= 16 and concurrency levels >= 1")
    from contextlib import nullcontext

    from corral.benchmarks.drafts.cases import extraction_cases
    from corral.benchmarks.drafts.runner import Side, run_drafts_bench
    from corral.benchmarks.serve.peer import resolve_peer_model
    from corral.benchmarks.serve.server_proc import ManagedServer

    managed = ManagedServer(args.server_args, args.out / "server.log") if args.server is None else None
    with managed if managed is not None else nullcontext():
        url = args.server or (managed.url if managed is not None else "")
        model = resolve_peer_model(url, None)
        sides = [Side(DRAFTS_ON, url, model, drafts=True, task=args.task),
                 Side(DRAFTS_OFF, url, model, drafts=False, task=args.task)]
        if args.peer_url:
            peer_model = resolve_peer_model(args.peer_url, args.peer_model)
            sides.append(Side(PEER, args.peer_url.rstrip("/"), peer_model, constraint=args.peer_constraint,
                              task=args.task))
        cases = extraction_cases(args.items)
        with bench.progress() as progress:
            progress.phase("passes", args.repeats * len(levels) * len(sides))
            runs = run_drafts_bench(sides, cases, levels, args.repeats, args.max_tokens, progress.advance)
    rows = summarise(runs, levels, [s.name for s in sides])
    bench.table(f"corral bench drafts ({model}, {args.items} e-mails, task {args.task}, greedy, median of "
                f"{args.repeats})",
                ["side", "c", "answers/s", "tok/s", "exact", "valid", "× no drafts", "× peer", "accepted",
                 "per draft"],
                [[r["side"], str(r["concurrency"]), f"{r['answers_per_s']:.3f}", f"{r['tokens_per_s']:.1f}",
                  f"{r['exact']:.0%}", f"{r['valid']:.0%}", _ratio(r.get("vs_no_drafts")), _ratio(r.get("vs_peer")),
                  _share(r.get("acceptance")), f"{r['accepted_per_draft']:.2f}" if r.get("accepted_per_draft")
                  else "-"] for r in rows])
    config = {"server": url, "model": model, "task": args.task, "items": args.items, "levels": levels,
              "repeats": args.repeats,
              "max_tokens": args.max_tokens, "peer_url": args.peer_url, "peer_constraint": args.peer_constraint}
    path = bench.write_results(config, [*rows, *({"run": run.as_dict()} for run in runs)])
    bench.wrote(path, _plot(bench, rows, levels, args.task))
    return 0


def summarise(runs: list[Any], levels: list[int], sides: list[str]) -> list[dict[str, Any]]:
    """Per side and level: medians over repeats, and each repeat's ratio to the other sides, medianed."""
    rows = []
    for level in levels:
        by_side = {name: [r for r in runs if r.side == name and r.concurrency == level] for name in sides}
        for name in sides:
            mine = by_side[name]
            row: dict[str, Any] = {
                "side": name, "concurrency": level,
                "answers_per_s": statistics.median(r.answers_per_s for r in mine),
                "tokens_per_s": statistics.median(r.tokens_per_s for r in mine),
                "exact": sum(r.exact for r in mine) / max(1, sum(r.answers + r.errors for r in mine)),
                "valid": sum(r.valid for r in mine) / max(1, sum(r.answers + r.errors for r in mine)),
                "errors": sum(r.errors for r in mine),
            }
            drafted = sum(r.draft_tokens for r in mine)
            if drafted:
                row["acceptance"] = sum(r.draft_accepted for r in mine) / drafted
                row["accepted_per_draft"] = sum(r.draft_accepted for r in mine) / max(1, sum(r.drafts for r in mine))
            for other, key in ((DRAFTS_OFF, "vs_no_drafts"), (PEER, "vs_peer")):
                if other != name and by_side.get(other):
                    pairs = zip(mine, by_side[other], strict=True)
                    row[key] = statistics.median(a.answers_per_s / b.answers_per_s for a, b in pairs
                                                 if b.answers_per_s)
            rows.append(row)
    return rows


def _ratio(value: float | None) -> str:
    return f"{value:.2f}×" if value else "-"


def _share(value: float | None) -> str:
    return f"{value:.0%}" if value is not None else "-"


def _plot(bench: Bench, rows: list[dict[str, Any]], levels: list[int], task: str) -> Any:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    sides = list(dict.fromkeys(r["side"] for r in rows))
    width = 0.8 / len(sides)
    for i, side in enumerate(sides):
        values = [next(r["answers_per_s"] for r in rows if r["side"] == side and r["concurrency"] == c)
                  for c in levels]
        ax.bar([j + i * width for j in range(len(levels))], values, width, label=side)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(levels))], [f"c{c}" for c in levels])
    ax.set_ylabel("answers per second")
    titles = {"extract": "answers to an e-mail, greedy: JSON extraction",
              "free": "answers to an e-mail, greedy: a reply in words", "plain": "text that copies nothing, greedy"}
    ax.set_title(titles[task])
    ax.legend()
    return save_figure(fig, bench.out / "drafts.png")
