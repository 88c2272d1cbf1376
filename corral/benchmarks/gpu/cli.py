"""`corral bench gpu`: the prepared device run of issue 50, one command for a lent GPU's few minutes.

It fails loudly at the first error: the CUDA tests first, then `corral bench serve` (free text and JSON Schema, then
`--kinds regex`) on random weights at a real model's shape (`--load-format dummy`) for each decoder, at every
concurrency level, and the device's copy bandwidth, which with the model's weight bytes gives the TPOT floor
at concurrency 1. One table and OUT/gpu.json hold what the issue asks for: TPOT against the floor, constrained
against free TPOT at each level, corral's decoder against transformers. Every piece runs on CPU with a tiny
shape in the test suite (`tests/benchmarks/test_gpu_bench.py`), so device minutes go to measuring.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from corral.benchmarks.harness import Bench, BenchExit, bench_command

REPO = Path(__file__).resolve().parents[3]
SAMPLE = REPO / "tests" / "data" / "jsonschemabench_sample"
CUDA_TESTS = ("tests/engine/test_vocab_ops.py", "tests/engine/test_decoder_equivalence.py",
              "tests/server/test_dummy_load.py")


def add_gpu_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    with bench_command(
        sub, "gpu", run_gpu,
        help="the prepared GPU run: CUDA tests, then serving at a real model's shape on random weights",
        description="Runs the CUDA tests, then `corral bench serve` (free text and JSON Schema, then regexes) "
        "against `corral serve --load-format dummy --model SHAPE` for each decoder at each concurrency level, "
        "and reads the device's copy bandwidth for the TPOT floor. Stops at the first error. Prints one table, "
        "writes OUT/gpu.json and each run's own results under OUT.",
        out="bench-out/gpu", width=160,
    ) as p:
        p.add_argument("--shape", default="llama-3.1-8b", help="a --load-format dummy shape or config.json "
                       "(default llama-3.1-8b)")
        p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="default cuda (cpu: a dry run)")
        p.add_argument("--impls", default="transformers,corral", help="decoders (default transformers,corral)")
        p.add_argument("--concurrency", default="1,8,32,64", help="levels (default 1,8,32,64)")
        p.add_argument("--requests-per-level", type=int, default=32, metavar="N", help="default 32")
        p.add_argument("--max-tokens", type=int, default=64, metavar="N", help="default 64")
        p.add_argument("--kinds", default="json,regex", help="json (free text and JSON Schema), regex "
                       "(default both)")
        p.add_argument("--data", type=Path, default=SAMPLE, metavar="DIR",
                       help="JSONSchemaBench schemas (default the sample under tests/data)")
        p.add_argument("--skip-tests", action="store_true", help="no CUDA tests first")


def run_gpu(args: argparse.Namespace, bench: Bench) -> int:
    started = time.monotonic()
    report: dict[str, Any] = {"shape": args.shape, "device": args.device, "device_name": _device_name(args.device)}
    if not args.skip_tests:
        report["tests"] = _run_tests(bench, args.out)
    report["bandwidth_gb_s"] = _copy_bandwidth_gb_s(args.device)
    top = max(int(c) for c in args.concurrency.split(","))
    runs: list[dict[str, Any]] = []
    for impl in args.impls.split(","):
        for kind in args.kinds.split(","):
            out = args.out / f"serve-{impl}-{kind}"
            server_args = (f"--load-format dummy --model {args.shape} --device {args.device} --dtype bfloat16 "
                           f"--model-impl {impl} --max-batch {top}")
            command = [sys.executable, "-m", "corral.server.cli", "bench", "serve", "--data", str(args.data),
                       "--schemas", "8", "--concurrency", args.concurrency, "--max-tokens", str(args.max_tokens),
                       "--requests-per-level", str(args.requests_per_level), "--no-baseline",
                       "--server-args", server_args, "--out", str(out)]
            if kind == "regex":
                command += ["--kinds", "regex"]
            elif kind != "json":
                raise BenchExit(f"unknown kind {kind!r}: json or regex")
            bench.console.print(f"{impl} / {kind}: {shlex.join(command[3:])}")
            _check(subprocess.run(command, cwd=REPO, capture_output=True, text=True), f"bench serve ({impl}, {kind})")
            results = json.loads((out / "results.json").read_text(encoding="utf-8"))
            weight_bytes = (results.get("bandwidth") or {}).get("weight_bytes")
            report.setdefault("weight_bytes", weight_bytes)
            for run in results["runs"]:
                runs.append({"impl": impl, "kind": kind, **{k: run.get(k) for k in (
                    "mode", "concurrency", "throughput_tok_s", "tpot_ms_p50", "ttft_ms_p50", "compliance", "errors")}})
    report["runs"] = runs
    report["floor_ms"] = _floor_ms(report.get("weight_bytes"), report["bandwidth_gb_s"])
    report["wall_s"] = round(time.monotonic() - started, 1)
    _table(bench, report)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "gpu.json"
    path.write_text(json.dumps(report, indent=2), encoding="utf-8")
    bench.wrote(path, wall_s=report["wall_s"])
    return 0


def _check(proc: subprocess.CompletedProcess[str], what: str) -> None:
    if proc.returncode != 0:
        raise BenchExit(f"{what} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def _device_name(device: str) -> str:
    import torch

    if device == "cuda":
        if not torch.cuda.is_available():
            raise BenchExit("--device cuda: torch sees no CUDA device here (--device cpu for a dry run)")
        return str(torch.cuda.get_device_name(0))
    return "cpu"


def _run_tests(bench: Bench, out: Path) -> dict[str, Any]:
    command = [sys.executable, "-m", "pytest", "-q", "-rs", *CUDA_TESTS, "-k", "cuda or dummy"]
    bench.console.print("tests: " + shlex.join(command[3:]))
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tests.log").write_text(proc.stdout + proc.stderr, encoding="utf-8")
    _check(proc, "the CUDA tests")
    return {"command": shlex.join(command[3:]), "summary": (proc.stdout.strip().splitlines() or [""])[-1]}


def _copy_bandwidth_gb_s(device: str) -> float:
    """Bytes read and written per second by a 1 GiB (CPU: 256 MiB) device-to-device copy, the best of five."""
    import torch

    size = (1 << 30) if device == "cuda" else (256 << 20)
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(5):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        target.copy_(source)
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return round(2 * size / best / 1e9, 1)


def _floor_ms(weight_bytes: int | None, bandwidth_gb_s: float) -> float | None:
    """One decode step reads every weight once: the least time a token can take at concurrency 1."""
    return round(weight_bytes / (bandwidth_gb_s * 1e9) * 1000, 3) if weight_bytes and bandwidth_gb_s else None


def _table(bench: Bench, report: dict[str, Any]) -> None:
    by_key = {(r["impl"], r["kind"], r["mode"], r["concurrency"]): r for r in report["runs"]}
    floor = report["floor_ms"]
    rows = []
    for (impl, kind, mode, level), run in by_key.items():
        if mode != "constrained":
            continue
        free = by_key.get((impl, kind, "unconstrained", level), {})  # the same prompts without the constraint
        other = by_key.get(("transformers" if impl == "corral" else "corral", kind, mode, level), {})
        tpot, free_tpot = run.get("tpot_ms_p50"), free.get("tpot_ms_p50")
        rows.append([impl, kind, str(level), _num(run.get("throughput_tok_s")), _num(free.get("throughput_tok_s")),
                     _num(tpot), _num(free_tpot), _ratio(tpot, free_tpot),
                     _ratio(free_tpot, floor) if level == 1 else "", _ratio(run.get("throughput_tok_s"),
                                                                            other.get("throughput_tok_s"))])
    bench.table(f"corral bench gpu: {report['shape']} on {report['device_name']} (floor {floor} ms a token at "
                f"{report['bandwidth_gb_s']} GB/s)",
                ["decoder", "kind", "c", "tok/s", "free tok/s", "TPOT ms", "free TPOT ms", "TPOT ÷ free",
                 "free TPOT ÷ floor", "tok/s ÷ other decoder"], rows, left=("decoder", "kind"))


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _ratio(top: float | None, bottom: float | None) -> str:
    return "-" if not top or not bottom else f"{top / bottom:.2f}"
