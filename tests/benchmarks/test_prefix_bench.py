"""`corral bench prefix` runs end to end on a short prompt and refuses bad arguments."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from conftest import run_bench


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return run_bench("prefix", *args)


def test_prefix_bench_times_each_scenario_with_the_cache_on_and_off(tmp_path: Path) -> None:
    done = _bench("--device", "cpu", "--prompt-tokens", "80", "--samples", "2", "--max-tokens", "2",
                  "--repeats", "1", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    results = {r["scenario"]: r for r in json.loads((tmp_path / "results.json").read_text())["results"]}
    assert len(results) == 6
    assert all(r["cached_ms"] > 0 and r["plain_ms"] > 0 for r in results.values())
    # The cold request finds nothing; the second request's system prompt and the second sample come from it.
    assert results["system prompt: first request (cold)"]["hit_tokens"] == 0
    assert results["system prompt: next request, same system prompt"]["hit_tokens"] == 80 // 16 * 16
    # All 5 full blocks of the 80-token prompt are shared, but its last token is always fed (its logits).
    assert results["n=2 samples: last sample's first token"]["hit_tokens"] == 79
    # 4 prompts on 2 slots: the second round finds each prompt's full blocks in the host store, not the slots.
    returning = "returning prompts (4 on 2 slots): second round's TTFT"
    assert results[f"{returning}, host store"]["hit_tokens"] >= 4 * 80 // 16 * 16
    assert results[f"{returning}, slots alone"]["hit_tokens"] < 4 * 16  # the opening word they all share
    assert (tmp_path / "prefix.png").stat().st_size > 0


def test_prefix_bench_refuses_bad_arguments(tmp_path: Path) -> None:
    done = _bench("--samples", "1", "--out", str(tmp_path))
    assert done.returncode == 2 and "--samples" in done.stdout
