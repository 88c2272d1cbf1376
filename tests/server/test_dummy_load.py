"""`--load-format dummy`: random weights at a real model's shapes (corral/server/models/dummy_weights.py), for
speed at a shape whose weights cannot travel. The same draw for the same shape, on both decoders; activations
that stay finite in bfloat16 at depth; grammar masks that still decide picks; a clear error for a bad shape."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_until_done

from corral.grammar_engines.compilation import GrammarCache
from corral.grammar_engines.protocol import TokenizerSpec
from corral.grammar_engines.registry import BackendSet
from corral.grammars.spec import GrammarSpec
from corral.server.engine import Engine, EngineConfig, SamplingParams, Sequence
from corral.server.engine.model_runner import ForwardRow, ModelRunner
from corral.server.models import ModelLoadError, load_model
from corral.server.models.dummy_weights import SHAPES, dummy_config, dummy_weights

# Qwen2's layout (q/k/v biases, an untied head) at a test's size, with a vocabulary wider than the tokenizer's.
SMALL: dict[str, Any] = {
    "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 130000, "tie_word_embeddings": False,
    "bos_token_id": 128000, "eos_token_id": [128009, 128001],
}


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("shape") / "config.json"
    path.write_text(json.dumps(SMALL), encoding="utf-8")
    return path


def test_every_shipped_shape_is_a_config_transformers_reads() -> None:
    for name, fields in SHAPES.items():
        config = dummy_config(name)
        assert config.model_type == fields["model_type"] and config.vocab_size == fields["vocab_size"], name


@pytest.mark.parametrize("tied", [False, True], ids=["own head", "tied head"])
def test_both_decoders_serve_the_same_draw(small: Path, tied: bool) -> None:
    """The draw is fixed by the seed: corral's decoder and transformers' give the same logits on it, with its own
    head or one tied to the embedding."""
    if tied:
        small = small.with_name("tied.json")
        small.write_text(json.dumps({**SMALL, "tie_word_embeddings": True}), encoding="utf-8")
    ours = load_model(str(small), device="cpu", dtype="float32", load_format="dummy", model_impl="corral")
    theirs = load_model(str(small), device="cpu", dtype="float32", load_format="dummy", model_impl="transformers")
    assert (ours.impl, theirs.impl, ours.vocab_size) == ("corral", "transformers", 130000)
    prompt = ours.tokenizer.encode("A person named Ada, 36, from London", add_special_tokens=True)
    runner = ModelRunner(ours, max_batch=1, max_len=64, prefix_cache=False)
    logits = runner.forward([ForwardRow(0, 0, prompt)])[0]
    with torch.inference_mode():
        reference = theirs.model(torch.tensor([prompt])).logits[0, -1].float()
    assert torch.allclose(logits, reference, atol=2e-4, rtol=1e-4)
    assert 0.3 < float(reference.std()) < 10.0  # picks are decided by a few units, not by one huge logit


def test_activations_stay_finite_and_near_one_in_bfloat16_at_depth() -> None:
    """Forty layers in bfloat16 (deeper than the 8B shape's 32): the residual stream stays near 1, the logits
    finite and spread."""
    from transformers import AutoModelForCausalLM

    config = dummy_config("llama-3.1-8b")
    config.update({"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 40, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1024})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(dummy_weights(config, torch.bfloat16, torch.device("cpu")), strict=True)
    with torch.inference_mode():
        out = model(torch.arange(3, 200).unsqueeze(0), output_hidden_states=True)
    last = out.hidden_states[-2].float()  # before the final norm
    assert torch.isfinite(out.logits).all() and 0.2 < float(last.std()) < 5.0
    assert 0.3 < float(out.logits.float().std()) < 10.0
    again = dummy_weights(config, torch.bfloat16, torch.device("cpu"))
    assert torch.equal(again["model.layers.7.mlp.down_proj.weight"],
                       model.model.layers[7].mlp.down_proj.weight.detach())


def test_a_schema_still_binds_on_random_weights(small: Path) -> None:
    """The engine answers under a JSON Schema with the dummy model: the answer is valid JSON of that shape."""
    loaded = load_model(str(small), device="cpu", load_format="dummy")
    cache = GrammarCache(BackendSet(TokenizerSpec(loaded.tokenizer, loaded.vocab_size, loaded.stop_token_ids)))
    schema = {"type": "object", "required": ["name", "age"], "additionalProperties": False,
              "properties": {"name": {"type": "string", "maxLength": 8},
                             "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
    compiled = cache.compile(GrammarSpec.json_schema(schema), "llguidance")
    backend = cache.backends.get(compiled.backend)
    engine = Engine(loaded, EngineConfig(max_batch=1, max_model_len=256))
    seq = Sequence(request_id="dummy", prompt_ids=loaded.tokenizer.encode("A person:", add_special_tokens=True),
                   params=SamplingParams(max_tokens=60, temperature=0.0), sink=lambda out: None,
                   matcher=backend.new_matcher(compiled.compiled), backend=backend)
    engine.add_request(seq)
    run_until_done(engine, [seq], max_steps=200)
    value = json.loads(loaded.tokenizer.decode(seq.output_ids, skip_special_tokens=True))
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)


def test_a_bad_shape_is_refused_with_the_shapes_named(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=re.escape("llama-3.1-8b, qwen2.5-7b")):
        load_model("llama-9000", device="cpu", load_format="dummy")
    bad = tmp_path / "config.json"
    bad.write_text('{"hidden_size": 64}', encoding="utf-8")
    with pytest.raises(ModelLoadError, match="no model_type"):
        load_model(str(bad), device="cpu", load_format="dummy")
    with pytest.raises(ModelLoadError, match="Unknown load format"):
        load_model("corral-tiny", device="cpu", load_format="pt")


def test_a_shape_with_fewer_rows_than_the_tokenizer_grows_to_it() -> None:
    """Llama 3.1's head has 128,256 rows and corral-tiny's tokenizer 128,257 tokens: the shape is served with the
    tokenizer's (checked at a test's width; the 8B's layers would take 16 GB)."""
    from unittest import mock

    from corral.server.models import dummy_weights

    small = {**dummy_weights.SHAPES["llama-3.1-8b"], "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
    with mock.patch.dict(dummy_weights.SHAPES, {"llama-3.1-8b": small}):
        loaded = load_model("llama-3.1-8b", device="cpu", load_format="dummy")
    assert loaded.vocab_size == len(loaded.tokenizer) == 128257
