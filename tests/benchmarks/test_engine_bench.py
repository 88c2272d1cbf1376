"""`corral bench engine` drives the engine at each level on the committed schema sample and refuses bad
arguments."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from conftest import SAMPLE_BENCH, run_bench


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return run_bench("engine", *args, timeout=600)


def test_engine_bench_reports_each_mode_and_level(tmp_path: Path) -> None:
    done = _bench("--data", str(SAMPLE_BENCH), "--schemas", "3", "--concurrency", "1,2", "--requests", "3",
                  "--max-tokens", "8", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    assert [(r["mode"], r["concurrency"]) for r in results] == [
        ("constrained", 1), ("constrained", 2), ("unconstrained", 1), ("unconstrained", 2)]
    for r in results:
        assert r["requests"] == 3 and r["steps"] > 0 and r["tokens_per_s"] > 0
        assert 0 < r["cpu_ms_per_step"] <= r["wall_ms_per_step"] * 1.05
        assert r["valid"] == r["finished"]  # every answer that ended on its own holds its schema
    # Free text ignores EOS: exactly max_tokens per request, one token per row per step.
    free = [r for r in results if r["mode"] == "unconstrained"]
    assert all(r["tokens"] == 3 * 8 for r in free)
    assert next(r for r in free if r["concurrency"] == 1)["steps"] == 3 * 8
    assert (tmp_path / "engine.png").stat().st_size > 0


def test_engine_bench_refuses_bad_arguments(tmp_path: Path) -> None:
    done = _bench("--data", str(SAMPLE_BENCH), "--modes", "fast", "--out", str(tmp_path))
    assert done.returncode == 2 and "--modes" in done.stdout


def test_engine_bench_names_a_model_it_cannot_load(tmp_path: Path) -> None:
    done = _bench("--data", str(SAMPLE_BENCH), "--model", "no-such-model", "--out", str(tmp_path))
    assert done.returncode == 2 and "no-such-model" in done.stdout
