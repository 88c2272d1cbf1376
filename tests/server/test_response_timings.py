"""`timings.tpot_ms` (corral/server/openai/extras.py): time per output token after the first, where a stop token the
model sampled counts as a token. It took a step like any other; left out, a short constrained answer that ends
on it was charged for a step it did not count, and its TPOT read high against free text's."""

from __future__ import annotations

import pytest
from conftest import run_until_done

from corral.grammars.request import ConstraintRequest
from corral.server.engine import Engine, EngineConfig, SamplingParams, Sequence
from corral.server.models import load_model
from corral.server.openai.extras import response_extras
from corral.server.prepared import Finished, Prepared


def _finished(output_ids: list[int], *, stop_sampled: bool, first: float, end: float) -> Finished:
    seq = Sequence(request_id="r", prompt_ids=[1, 2], params=SamplingParams(max_tokens=16), sink=lambda out: None)
    seq.output_ids = list(output_ids)
    seq.stats.first_token, seq.stats.last_token, seq.stats.finished = first, end, end
    seq.stats.stop_sampled = stop_sampled
    prepared = Prepared("r", [1, 2], seq.params, ConstraintRequest(spec=None), None, received=first)
    return Finished(text="", finish_reason="stop", seq=seq, check=None, prepared=prepared)


def test_a_sampled_stop_token_counts_in_tpot() -> None:
    # Three output tokens, then the stop token: four sampled tokens, 300 ms from the first to the last.
    timings = response_extras(_finished([5, 6, 7], stop_sampled=True, first=10.0, end=10.3))["timings"]
    assert timings["tpot_ms"] == pytest.approx(100.0)


def test_without_a_sampled_stop_token_tpot_is_over_the_output_tokens() -> None:
    # A length cut, a stop string or a grammar that ended the answer: no token beyond the output.
    timings = response_extras(_finished([5, 6, 7], stop_sampled=False, first=10.0, end=10.3))["timings"]
    assert timings["tpot_ms"] == pytest.approx(150.0)


def test_one_token_and_its_stop_token_have_a_tpot() -> None:
    timings = response_extras(_finished([5], stop_sampled=True, first=10.0, end=10.05))["timings"]
    assert timings["tpot_ms"] == pytest.approx(50.0)
    assert response_extras(_finished([5], stop_sampled=False, first=10.0, end=10.05))["timings"]["tpot_ms"] is None


def test_the_engine_marks_an_answer_that_ended_on_a_sampled_stop_token() -> None:
    loaded = load_model("corral-tiny", device="cpu")
    engine = Engine(loaded, EngineConfig(max_batch=2, max_model_len=256))
    stop = loaded.stop_token_ids[0]
    prompt = list(loaded.tokenizer.encode("Answer:", add_special_tokens=True))
    # Biased to the top, the stop token is the first pick: an empty answer that ended on it.
    ends = Sequence("ends", prompt, SamplingParams(max_tokens=8, temperature=0.0, logit_bias={stop: 100.0}),
                    sink=lambda out: None)
    cut = Sequence("cut", prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), sink=lambda out: None)
    for seq in (ends, cut):
        engine.add_request(seq)
    run_until_done(engine, [ends, cut])
    assert ends.finish_reason == "stop" and ends.stats.stop_sampled
    assert cut.finish_reason == "length" and len(cut.output_ids) == 3 and not cut.stats.stop_sampled
