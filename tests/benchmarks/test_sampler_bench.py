"""`corral bench sampler` runs end to end on a small vocabulary and refuses bad arguments."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import torch
from conftest import run_bench

from corral.benchmarks.sampler.runner import CONFIGS, reference_sample
from corral.server.engine.sampling import SamplingParams, sample_rows


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return run_bench("sampler", *args)


def test_sampler_bench_writes_a_row_per_configuration_and_batch(tmp_path: Path) -> None:
    done = _bench("--vocab", "3000", "--batches", "1,2", "--repeats", "1", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    assert [(r["config"], r["batch"]) for r in results] == [(c, b) for c, _ in CONFIGS for b in (1, 2)]
    assert all(r["corral_ms"] > 0 and r["reference_ms"] > 0 for r in results)
    assert (tmp_path / "sampler.png").stat().st_size > 0
    assert "greedy (temperature 0)" in done.stdout


def test_sampler_bench_refuses_bad_batches(tmp_path: Path) -> None:
    done = _bench("--batches", "0", "--out", str(tmp_path))
    assert done.returncode == 2 and "--batches" in done.stdout


def test_the_reference_and_corral_agree_on_greedy_rows() -> None:
    logits = torch.randn(3, 3000, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0)] * 3
    assert sample_rows(logits.clone(), params, [None] * 3).tokens == reference_sample(logits, params)
