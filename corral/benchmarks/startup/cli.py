"""`corral bench startup`: how long `corral serve` takes to answer, cold (an empty cache: a built-in or GGUF
model is converted first) and warm (converted model reused), and what memory the serving process holds."""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from corral.benchmarks.harness import Bench, BenchExit, bench_command, pyplot, save_figure


def add_startup_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    with bench_command(
        sub, "startup", run_startup,
        help="time to a healthy server, cold (conversion included) and warm, and its memory",
        description="Starts `corral serve --model MODEL` as a subprocess: once with an empty cache directory "
        "(a built-in or GGUF model is converted first; skipped with --no-cold), then --warm times with the "
        "cache that run filled (or $CORRAL_CACHE_DIR with --no-cold). Each run: seconds until /health answers, "
        "then one greedy request, then the process's resident memory (VmRSS) and its peak (VmHWM). Prints a "
        "table, writes OUT/results.json and OUT/startup.png.",
        server_args="extra `corral serve` flags", out="bench-out/startup", width=120,
    ) as p:
        p.add_argument("--model", default="gemma-3-270m", help="what `--model` serves (default gemma-3-270m)")
        p.add_argument("--warm", type=int, default=2, metavar="N", help="warm starts (default 2)")
        p.add_argument("--no-cold", action="store_true", help="skip the cold start (use $CORRAL_CACHE_DIR)")


def _memory_mb(pid: int) -> dict[str, float]:
    fields: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024  # kB -> MiB
    return fields


def _one_start(model: str, server_args: str, log_path: Path) -> dict[str, Any]:
    import httpx

    from corral.benchmarks.serve.server_proc import ManagedServer

    started = time.perf_counter()
    with ManagedServer(f"--model {model} {server_args}", log_path, startup_timeout_s=900) as server:
        healthy_s = time.perf_counter() - started
        body = {"model": "default", "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}
        answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()
        assert server.pid is not None
        memory = _memory_mb(server.pid)
    return {"healthy_s": round(healthy_s, 2), "rss_mib": round(memory.get("VmRSS", 0.0)),
            "peak_rss_mib": round(memory.get("VmHWM", 0.0)), "text": answer["choices"][0]["text"]}


def run_startup(args: argparse.Namespace, bench: Bench) -> int:
    if args.warm < 0 or (args.no_cold and args.warm == 0):
        raise BenchExit("nothing to run (--warm must be >= 0, >= 1 with --no-cold)")
    rows: list[dict[str, Any]] = []
    previous = os.environ.get("CORRAL_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="corral-startup-") as empty:
        try:
            if not args.no_cold:
                os.environ["CORRAL_CACHE_DIR"] = empty  # the server process inherits it
            for run in ([] if args.no_cold else ["cold"]) + [f"warm {i + 1}" for i in range(args.warm)]:
                bench.console.print(f"{run} start of {args.model} ...")
                row = {"run": run, "model": args.model, **_one_start(args.model, args.server_args,
                                                                    args.out / f"server-{run.replace(' ', '')}.log")}
                rows.append(row)
        finally:
            if previous is None:
                os.environ.pop("CORRAL_CACHE_DIR", None)
            else:
                os.environ["CORRAL_CACHE_DIR"] = previous
    bench.table(f"corral serve --model {args.model}: time to healthy and memory",
                ["run", "healthy (s)", "RSS (MiB)", "peak RSS (MiB)", "first answer"],
                [[row["run"], f"{row['healthy_s']:.1f}", str(row["rss_mib"]), str(row["peak_rss_mib"]),
                  repr(row["text"][:40])] for row in rows], left=("run", "first answer"))
    path = bench.write_results({"model": args.model, "server_args": args.server_args}, rows)
    _plot(bench.plot_path, rows, args.model)
    bench.wrote(path, bench.plot_path)
    return 0


def _plot(path: Path, rows: list[dict[str, Any]], model: str) -> None:
    fig, (left, right) = pyplot().subplots(1, 2, figsize=(9, 3.5))
    labels = [r["run"] for r in rows]
    left.bar(labels, [r["healthy_s"] for r in rows], color="#4c72b0")
    left.set_ylabel("seconds to /health")
    right.bar(labels, [r["peak_rss_mib"] for r in rows], color="#dd8452", label="peak")
    right.bar(labels, [r["rss_mib"] for r in rows], color="#55a868", label="after one answer")
    right.set_ylabel("MiB")
    right.legend()
    fig.suptitle(f"corral serve --model {model}")
    save_figure(fig, path, dpi=100)
