"""`corral bench paired` against a live corral (corral-tiny) and a stand-in for llama-server that answers with
llama-server's `timings` fields: the table, the medians and the ratios it writes come from both sides' figures."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import RunningServer, run_bench, stub_peer


def _llama_like_answer(body: dict[str, Any]) -> dict[str, Any]:
    """Every chat request answered as llama-server does, with a fixed TPOT of 50 ms and prefill of 100 tok/s."""
    return {"choices": [{"message": {"content": "x"}}],
            "timings": {"predicted_per_token_ms": 50.0, "prompt_per_second": 100.0}}


@pytest.fixture()
def llama_like() -> Iterator[str]:
    with stub_peer(_llama_like_answer) as url:
        yield url


def test_paired_rounds_compare_both_sides_timings(server: RunningServer, llama_like: str, tmp_path: Path) -> None:
    done = run_bench("paired", "--server", server.base_url, "--peer-url", llama_like, "--rounds", "2",
                     "--tokens", "8", "--prompt-words", "20", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "TPOT ms" in done.stdout and "prefill tok/s" in done.stdout
    results = json.loads((tmp_path / "results.json").read_text())
    assert len(results["samples"]["corral_tpot_ms"]) == 2 and results["samples"]["peer_tpot_ms"] == [50.0, 50.0]
    corral_tpot = results["medians"]["corral_tpot_ms"]
    assert corral_tpot > 0 and results["ratios"]["tpot"] == pytest.approx(50.0 / corral_tpot)
    assert results["ratios"]["prefill"] == pytest.approx(results["medians"]["corral_prefill_tok_s"] / 100.0)
    assert (tmp_path / "paired.png").stat().st_size > 0
