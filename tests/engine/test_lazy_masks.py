"""Lazy masks: greedy rows in wide grammar states skip their fill and are checked after the pick, which
changes nothing but how many masks are filled (corral/structured/lazy_masks.py)."""

from __future__ import annotations

import pytest
from conftest import run_until_done

from corral.grammar_engines.compilation import GrammarCache
from corral.grammar_engines.protocol import TokenizerSpec
from corral.grammar_engines.registry import BackendSet
from corral.grammars.contract import validate_output
from corral.grammars.spec import GrammarSpec
from corral.server.engine import Engine, EngineConfig, SamplingParams, Sequence
from corral.server.models import LoadedModel, load_model
from corral.structured.lazy_masks import MAX_STREAK, MIN_ODDS, MISS_BACKOFF, PROBE_EVERY, LazyMasks, LazyMaskState


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model("corral-tiny", device="cpu")


@pytest.fixture(scope="module")
def cache(loaded: LoadedModel) -> GrammarCache:
    return GrammarCache(BackendSet(TokenizerSpec(loaded.tokenizer, loaded.vocab_size, loaded.stop_token_ids)))


def generate(
    loaded: LoadedModel, cache: GrammarCache, specs: list[GrammarSpec], backend: str, *, lazy: bool
) -> list[Sequence]:
    """Each spec answered greedily, all in one batch (rows skip and fill side by side)."""
    engine = Engine(loaded, EngineConfig(max_batch=len(specs), max_model_len=512, lazy_masks=lazy))
    engine.structured.lazy.min_fill_us = 0.0  # the tiny model's fills are cheap: let every wide one skip
    seqs = []
    for i, spec in enumerate(specs):
        compiled = cache.compile(spec, backend)
        impl = cache.backends.get(compiled.backend)
        prompt = loaded.tokenizer.encode(f"Answer {i}:", add_special_tokens=True)
        # The tiny model's pick is its end of text almost everywhere, which a check always refuses (the mask
        # decides where an answer may end): banned, its picks are other tokens, and each answer ends where its
        # grammar does.
        params = SamplingParams(max_tokens=64, temperature=0.0, logit_bias=dict.fromkeys(loaded.stop_token_ids, -1e4))
        seq = Sequence(request_id=f"lazy-{i}", prompt_ids=list(prompt), params=params, sink=lambda out: None,
                       matcher=impl.new_matcher(compiled.compiled), backend=impl)
        engine.add_request(seq)
        seqs.append(seq)
    run_until_done(engine, seqs, max_steps=600)
    return seqs


# Long enough that the tiny model's first picks (often its end of text) cannot end them.
SPECS = [
    GrammarSpec.regex(r"[^\n]{30,60}"),  # nearly every token allowed: picks are mostly allowed as they are
    GrammarSpec.regex(r"([a-z]{1,8} ){6,12}[a-z]{1,8}"),  # wide, but most of a random model's picks are refused
    GrammarSpec.json_schema({"type": "object", "required": ["note"],
                             "properties": {"note": {"type": "string", "minLength": 30, "maxLength": 40}}}),
    GrammarSpec.lark("start: /[a-zA-Z0-9 ,.]{30,60}/"),
]


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_lazy_masks_give_the_same_answers_with_fewer_fills(
    loaded: LoadedModel, cache: GrammarCache, backend: str
) -> None:
    masked = generate(loaded, cache, SPECS, backend, lazy=False)
    lazy = generate(loaded, cache, SPECS, backend, lazy=True)
    for spec, full, quick in zip(SPECS, masked, lazy, strict=True):
        assert quick.text == full.text, spec.source
        assert quick.finish_reason == full.finish_reason
        assert quick.error is None and validate_output(spec, quick.text).valid, quick.text
        assert full.lazy_mask.skipped == 0 and full.lazy_mask.refilled == 0
    # Both halves of the check ran: picks taken as they were, and refused picks re-picked under the mask.
    assert sum(s.lazy_mask.skipped for s in lazy) > 0
    assert sum(s.lazy_mask.refilled for s in lazy) > 0
    fills = sum(len(s.stats.mask_us) for s in lazy)
    assert fills < sum(len(s.stats.mask_us) for s in masked)


def test_only_greedy_rows_without_logprobs_whose_last_mask_was_wide_and_costly_skip() -> None:
    policy = LazyMasks(wide_above=100, min_fill_us=500.0)
    greedy = SamplingParams(temperature=0.0)

    def skips(state: LazyMaskState, params: SamplingParams = greedy, constrained: bool = True) -> bool:
        return policy.skips(state, params, grammar="g" if constrained else None, produced=0)

    state = LazyMaskState()
    assert not skips(state)  # no mask filled yet
    policy.filled(state, allowed=5000, fill_us=900.0)
    assert skips(state)
    assert not skips(state, constrained=False)
    assert not skips(state, SamplingParams(temperature=0.7))  # a draw is over the masked distribution
    assert not skips(state, SamplingParams(temperature=0.0, logprobs=True))  # so are reported logprobs
    assert not LazyMasks(wide_above=100, enabled=False).skips(state, greedy, grammar="g", produced=0)
    policy.filled(state, allowed=50, fill_us=900.0)  # narrow: its head may be cut to the allowed ids
    assert not skips(state)
    policy.filled(state, allowed=5000, fill_us=100.0)  # cheap: the fill overlaps the forward anyway
    assert not skips(state)


def test_a_refused_pick_backs_off_doubling_and_a_long_streak_gets_a_mask() -> None:
    policy = LazyMasks(wide_above=100, min_fill_us=0.0)
    greedy = SamplingParams(temperature=0.0)
    state, produced = LazyMaskState(), 0

    def skips() -> bool:
        return policy.skips(state, greedy, grammar="g", produced=produced)

    policy.filled(state, allowed=5000, fill_us=1.0)
    for _ in range(MAX_STREAK):
        assert skips()
        policy.checked(state, "g", allowed=True, produced=produced)
        produced += 1
    assert not skips()  # a masked step now re-reads how wide the state is
    policy.filled(state, allowed=5000, fill_us=1.0)
    assert skips()
    waits = []
    for _ in range(3):
        policy.checked(state, "g", allowed=False, produced=produced)
        policy.filled(state, allowed=5000, fill_us=1.0)
        steps = 0
        while not skips():
            produced += 1
            steps += 1
        waits.append(steps)
    assert waits == [MISS_BACKOFF, 2 * MISS_BACKOFF, 4 * MISS_BACKOFF]
    policy.checked(state, "g", allowed=True, produced=produced)  # an allowed pick ends the run of refusals
    policy.checked(state, "g", allowed=False, produced=produced)
    assert state.resume_at == produced + MISS_BACKOFF
    assert (state.skipped, state.refilled) == (MAX_STREAK + 1, 4)


def test_a_grammar_whose_picks_are_mostly_refused_makes_its_new_rows_skip_only_to_probe() -> None:
    policy = LazyMasks(wide_above=100, min_fill_us=0.0)
    greedy = SamplingParams(temperature=0.0)

    def fresh_row() -> LazyMaskState:  # a new request's row, its last mask wide
        state = LazyMaskState()
        policy.filled(state, allowed=5000, fill_us=1.0)
        return state

    refusing, passing = ("xgrammar", "csv"), ("xgrammar", "sql")
    while policy.odds(refusing).passed >= MIN_ODDS:  # short answers: each request refused once, then it ends
        policy.checked(fresh_row(), refusing, allowed=False, produced=0)
    policy.checked(fresh_row(), passing, allowed=False, produced=0)  # one refusal is not a trend
    row = fresh_row()
    tries = [policy.skips(row, greedy, grammar=refusing, produced=0) for _ in range(4 * PROBE_EVERY)]
    assert sum(tries) == 4  # one eligible step in PROBE_EVERY still skips, so the odds can recover
    assert policy.skips(fresh_row(), greedy, grammar=passing, produced=0)
    while policy.odds(refusing).passed < MIN_ODDS:
        policy.checked(fresh_row(), refusing, allowed=True, produced=0)
    assert policy.skips(fresh_row(), greedy, grammar=refusing, produced=0)
