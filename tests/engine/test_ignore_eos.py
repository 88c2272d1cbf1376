"""ignore_eos bans the stop tokens of its own row only, every step, even where they would be the pick."""

from __future__ import annotations

from conftest import run_until_done

from corral.server.engine import Engine, EngineConfig, SamplingParams, Sequence
from corral.server.models import load_model


def test_ignore_eos_runs_past_a_favoured_stop_token_while_its_neighbour_stops() -> None:
    loaded = load_model("corral-tiny", device="cpu")
    engine = Engine(loaded, EngineConfig(max_batch=4, max_model_len=256))
    prompt = list(loaded.tokenizer.encode("Answer:", add_special_tokens=True))
    favoured = dict.fromkeys(loaded.stop_token_ids, 100.0)  # every stop token biased to the top
    stops = Sequence(
        "stops", prompt, SamplingParams(max_tokens=6, temperature=0.0, logit_bias=favoured), sink=lambda out: None
    )
    runs = [
        Sequence(
            f"runs{i}",
            prompt,
            SamplingParams(max_tokens=6, temperature=0.0, logit_bias=favoured, ignore_eos=True),
            sink=lambda out: None,
        )
        for i in range(2)
    ]
    for seq in (runs[0], stops, runs[1]):  # the stopping row between the two banned ones
        engine.add_request(seq)
    run_until_done(engine, [stops, *runs])
    assert stops.finish_reason == "stop" and stops.output_ids == []
    for seq in runs:
        assert seq.finish_reason == "length" and len(seq.output_ids) == 6
        assert not set(seq.output_ids) & set(loaded.stop_token_ids)
