"""`corral bench projection` runs end to end on small shapes and refuses bad arguments."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from conftest import run_bench


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return run_bench("projection", *args)


def test_projection_bench_writes_a_row_per_shape_dtype_and_batch(tmp_path: Path) -> None:
    done = _bench("--shapes", "1024x512,96x64", "--batches", "1,4", "--repeats", "1", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    expected = [(s, d, b) for s in ("1024x512", "96x64") for d in ("float32", "bfloat16") for b in (1, 4)]
    assert [(r["shape"], r["dtype"], r["rows"]) for r in results] == expected
    assert all(r["corral_ms"] > 0 and r["plain_ms"] > 0 for r in results)
    # The small weight never takes the packed path; both paths compute the same product.
    assert not any(r["packed"] for r in results if r["shape"] == "96x64")
    assert all(r["max_abs_diff"] < (1e-3 if r["dtype"] == "float32" else 0.1) for r in results)
    assert (tmp_path / "projection.png").stat().st_size > 0


def test_projection_bench_refuses_bad_shapes(tmp_path: Path) -> None:
    done = _bench("--shapes", "12by3", "--out", str(tmp_path))
    assert done.returncode == 2 and "--shapes" in done.stdout
