"""Jump-forward: tokens the grammar forces are appended without sampling, and change nothing but speed."""

from __future__ import annotations

import json
from typing import Any

import pytest

from corral.grammar_engines.compilation import GrammarCache
from corral.grammar_engines.protocol import TokenizerSpec
from corral.grammar_engines.registry import BackendSet
from corral.grammars.contract import validate_output
from corral.grammars.spec import GrammarSpec
from corral.server.engine import Engine, EngineConfig, SamplingParams, Sequence
from corral.server.models import LoadedModel, load_model


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model("corral-tiny", device="cpu")


@pytest.fixture(scope="module")
def cache(loaded: LoadedModel) -> GrammarCache:
    return GrammarCache(BackendSet(TokenizerSpec(loaded.tokenizer, loaded.vocab_size, loaded.stop_token_ids)))


def generate(loaded: LoadedModel, cache: GrammarCache, spec: GrammarSpec, backend: str, jump: bool) -> Sequence:
    engine = Engine(loaded, EngineConfig(max_batch=2, max_model_len=512, jump_forward=jump))
    compiled = cache.compile(spec, backend)
    impl = cache.backends.get(compiled.backend)
    prompt = loaded.tokenizer.encode("Answer:", add_special_tokens=True)
    seq = Sequence(request_id="jf", prompt_ids=list(prompt), params=SamplingParams(max_tokens=120, temperature=0.0),
                   sink=lambda out: None, matcher=impl.new_matcher(compiled.compiled), backend=impl)
    engine.add_request(seq)
    for _ in range(400):
        if seq.is_finished:
            break
        engine.step()
    assert seq.is_finished
    return seq


FULLY_FORCED: dict[str, Any] = {
    "type": "object",
    "properties": {"greeting": {"const": "hello world"}, "count": {"enum": [12345]}},
    "required": ["greeting", "count"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_forced_tokens_give_the_same_text_as_greedy_one_by_one(
    loaded: LoadedModel, cache: GrammarCache, backend: str
) -> None:
    spec = GrammarSpec.json_schema(FULLY_FORCED)
    one_by_one = generate(loaded, cache, spec, backend, jump=False)
    forced = generate(loaded, cache, spec, backend, jump=True)
    assert forced.text == one_by_one.text
    assert json.loads(forced.text) == {"greeting": "hello world", "count": 12345}
    assert forced.stats.forced_tokens > 0 and one_by_one.stats.forced_tokens == 0
    assert len(forced.stats.forward_ms) < len(one_by_one.stats.forward_ms)  # fewer model steps


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_partly_forced_output_stays_valid_with_fewer_steps(
    loaded: LoadedModel, cache: GrammarCache, backend: str
) -> None:
    schema = {
        "type": "object",
        "properties": {"identifier": {"type": "integer"}, "description_of_item": {"type": "boolean"}},
        "required": ["identifier", "description_of_item"],
        "additionalProperties": False,
    }
    spec = GrammarSpec.json_schema(schema)
    one_by_one = generate(loaded, cache, spec, backend, jump=False)
    forced = generate(loaded, cache, spec, backend, jump=True)
    for seq in (one_by_one, forced):
        assert seq.finish_reason == "stop", seq.text
        assert validate_output(spec, seq.text).valid, seq.text
    assert len(forced.stats.forward_ms) < len(one_by_one.stats.forward_ms)
