"""Logprob recording in the real Engine: one entry per output token, 0.0 for jump-forward tokens, retracted
with a revision, cut with a stop string, and streamed exactly once each."""

from __future__ import annotations

from typing import Any

import pytest

from corral.grammar_engines.compilation import GrammarCache
from corral.grammar_engines.protocol import TokenizerSpec
from corral.grammar_engines.registry import BackendSet
from corral.grammars.spec import GrammarSpec
from corral.server.engine import Engine, EngineConfig, SamplingParams, SeqOutput, Sequence
from corral.server.models import LoadedModel, load_model
from corral.structured.watchdog import Trip


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model("corral-tiny", device="cpu")


@pytest.fixture(scope="module")
def cache(loaded: LoadedModel) -> GrammarCache:
    return GrammarCache(BackendSet(TokenizerSpec(loaded.tokenizer, loaded.vocab_size, loaded.stop_token_ids)))


def start(
    loaded: LoadedModel, cache: GrammarCache, spec: GrammarSpec, **params: Any
) -> tuple[Engine, Sequence, list[SeqOutput]]:
    engine = Engine(loaded, EngineConfig(max_batch=2, max_model_len=512, revision_token_id=loaded.revision_token_id))
    compiled = cache.compile(spec, "llguidance")
    backend = cache.backends.get(compiled.backend)
    outputs: list[SeqOutput] = []
    seq = Sequence(
        request_id="lp",
        prompt_ids=list(loaded.tokenizer.encode("Answer:", add_special_tokens=True)),
        params=SamplingParams(**{"max_tokens": 80, "temperature": 0.0, "logprobs": True, "top_logprobs": 3, **params}),
        sink=outputs.append,
        matcher=backend.new_matcher(compiled.compiled),
        backend=backend,
    )
    engine.add_request(seq)
    return engine, seq, outputs


def finish(engine: Engine, seq: Sequence) -> None:
    for _ in range(300):
        if seq.is_finished:
            return
        engine.step()
    raise AssertionError("did not finish")


def assert_entries_match(seq: Sequence, outputs: list[SeqOutput]) -> None:
    assert [e.token for e in seq.logprobs] == seq.output_ids[: len(seq.logprobs)]
    streamed = [e for out in outputs for e in out.logprobs]
    assert streamed == seq.logprobs  # every entry sent once, in order, none retracted after it went out


def test_jump_forward_tokens_have_logprob_zero(loaded: LoadedModel, cache: GrammarCache) -> None:
    schema = {
        "type": "object",
        "properties": {"greeting": {"const": "hello world"}, "n": {"type": "integer"}},
        "required": ["greeting", "n"],
        "additionalProperties": False,
    }
    engine, seq, outputs = start(loaded, cache, GrammarSpec.json_schema(schema))
    finish(engine, seq)
    assert seq.finish_reason == "stop" and seq.stats.forced_tokens > 0
    assert len(seq.logprobs) == len(seq.output_ids)
    certain = [e for e in seq.logprobs if e.logprob == 0.0 and e.top == ((e.token, 0.0),)]
    assert len(certain) >= seq.stats.forced_tokens
    assert all(e.logprob <= 0.0 and len(e.top) <= 3 for e in seq.logprobs)
    assert_entries_match(seq, outputs)


def test_a_revision_drops_the_retracted_tokens_entries(loaded: LoadedModel, cache: GrammarCache) -> None:
    properties = {"a": {"type": "integer"}, "b": {"type": "string"}}
    schema = {"type": "object", "properties": properties, "required": ["a", "b"]}
    engine, seq, outputs = start(loaded, cache, GrammarSpec.json_schema(schema))
    for _ in range(4):
        engine.step()
    assert not seq.is_finished
    before = len(seq.logprobs)
    engine._revise(seq, Trip.DEAD_END)  # the path a sampled revision token takes
    assert len(seq.logprobs) == len(seq.output_ids) < before
    finish(engine, seq)
    assert len(seq.logprobs) == len(seq.output_ids)
    assert_entries_match(seq, outputs)


def test_a_stop_string_cut_keeps_the_entries_of_the_tokens_that_reach_it(
    loaded: LoadedModel, cache: GrammarCache
) -> None:
    spec = GrammarSpec.regex("[a-z]{6}-[a-z]{6}-[a-z]{6}")
    engine, seq, _ = start(loaded, cache, spec)
    finish(engine, seq)
    full = seq.text
    stop = full[9:11]
    engine, seq, outputs = start(loaded, cache, spec, stop=(stop,))
    finish(engine, seq)
    assert seq.text_cut and seq.text == full[: full.find(stop)] and seq.text
    decode = loaded.tokenizer.decode
    kept = [e.token for e in seq.logprobs]
    assert decode(kept).startswith(seq.text) and len(decode(kept[:-1])) < len(seq.text)
    assert_entries_match(seq, outputs)
