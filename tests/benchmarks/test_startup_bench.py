"""`corral bench startup` as a user runs it: a cold start into an empty cache and a warm one, each timed to a
healthy server, with the serving process's memory."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import run_bench


def test_startup_bench_times_a_cold_and_a_warm_start(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = run_bench("startup", "--model", "corral-tiny", "--warm", "1", "--out", str(out), timeout=300)
    assert done.returncode == 0, done.stderr + done.stdout
    rows = json.loads((out / "results.json").read_text())["results"]
    assert [r["run"] for r in rows] == ["cold", "warm 1"]
    for row in rows:
        assert row["healthy_s"] > 0 and 0 < row["rss_mib"] <= row["peak_rss_mib"]
        assert isinstance(row["text"], str)  # the warm-up answer (corral-tiny may end at once)
    assert (out / "startup.png").stat().st_size > 0
    assert "time to healthy and memory" in done.stdout


def test_startup_bench_refuses_nothing_to_run(tmp_path: Path) -> None:
    done = run_bench("startup", "--no-cold", "--warm", "0", "--out", str(tmp_path))
    assert done.returncode == 2 and "nothing to run" in done.stdout
