"""`corral bench gpu`, the prepared device run (issue 50), dry-run on the CPU with a tiny shape so that a lent GPU's
minutes go to measuring: it serves the dummy shape, reads the copy bandwidth, writes gpu.json with every level's
runs and the TPOT floor; asked for CUDA where there is none, it stops at once and says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from corral.server.cli import main

TINY_SHAPE = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128256, "tie_word_embeddings": False,
    "bos_token_id": 128000, "eos_token_id": [128009, 128001],
}


def test_a_dry_run_on_the_cpu_writes_every_run_and_the_floor(tmp_path: Path) -> None:
    shape = tmp_path / "config.json"
    shape.write_text(json.dumps(TINY_SHAPE), encoding="utf-8")
    out = tmp_path / "gpu"
    code = main(["bench", "gpu", "--device", "cpu", "--shape", str(shape), "--impls", "corral", "--kinds", "json",
                 "--concurrency", "1,2", "--requests-per-level", "2", "--max-tokens", "8", "--skip-tests",
                 "--out", str(out)])
    assert code == 0
    report = json.loads((out / "gpu.json").read_text(encoding="utf-8"))
    assert report["device_name"] == "cpu" and report["bandwidth_gb_s"] > 0 and report["floor_ms"] > 0
    seen = {(r["mode"], r["concurrency"]) for r in report["runs"]}
    assert seen == {(mode, level) for mode in ("constrained", "unconstrained") for level in (1, 2)}
    assert all(r["errors"] == 0 and r["throughput_tok_s"] > 0 for r in report["runs"])
    assert all(r["compliance"] == 1.0 for r in report["runs"] if r["mode"] == "constrained" and r["compliance"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="there is a GPU here: nothing to refuse")
def test_cuda_asked_where_there_is_none_stops_at_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "gpu", "--skip-tests", "--out", str(tmp_path)])
    assert code != 0
    assert "torch sees no CUDA device" in capsys.readouterr().out
    assert not (tmp_path / "gpu.json").exists()
