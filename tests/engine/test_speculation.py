"""Speculative decoding (corral/server/engine/speculation.py, drafting.py): drafts looked up in the prompt and the
answer,
cut by the grammar, verified in one forward. The answer is token for token the one without drafts, on every
constraint kind and both engines, alone and in a batch; only greedy rows draft."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from conftest import run_until_done

from corral.grammar_engines.compilation import GrammarCache
from corral.grammar_engines.protocol import Matcher, TokenizerSpec, allocate_bitmask
from corral.grammar_engines.registry import BackendSet
from corral.grammars.spec import GrammarSpec
from corral.server.engine import Engine, EngineConfig, SamplingParams, Sequence
from corral.server.engine.drafting import (
    DraftCounts,
    KindHistory,
    NgramIndex,
    PromptText,
    propose,
)
from corral.server.engine.speculation import Speculation, best_length
from corral.server.engine.step_cost import COST_MAX_AGE, GUESS_PRIOR, REFIT_EVERY, CostParts, StepCost, StepShape
from corral.server.models import LoadedModel, load_model


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model("corral-tiny", device="cpu")


@pytest.fixture(scope="module")
def cache(loaded: LoadedModel) -> GrammarCache:
    return GrammarCache(BackendSet(TokenizerSpec(loaded.tokenizer, loaded.vocab_size, loaded.stop_token_ids)))


# A prompt whose text repeats, so lookups find continuations; the tiny model's greedy answers loop as well.
PROMPT = "name: Ada Lovelace, city: London, year: 1843. " * 6


def generate(
    loaded: LoadedModel,
    cache: GrammarCache,
    specs: list[GrammarSpec | None],
    backend: str,
    *,
    drafts: int,
    params: SamplingParams | None = None,
) -> list[Sequence]:
    """Each spec (None: free text) answered in one batch, drafts on (always worth it: a fixed cheap cost) or off."""
    engine = Engine(loaded, EngineConfig(max_batch=len(specs), max_model_len=512, draft_tokens=drafts))
    engine.speculation.cost.parts = lambda: CostParts(10.0, 0.1, 0.1, 0.0, 0.1, guess_share=0.01)  # type: ignore[method-assign]
    seqs = []
    for i, spec in enumerate(specs):
        matcher = impl = None
        if spec is not None:
            compiled = cache.compile(spec, backend)
            impl = cache.backends.get(compiled.backend)
            matcher = impl.new_matcher(compiled.compiled)
        prompt = loaded.tokenizer.encode(f"{PROMPT} {i}:", add_special_tokens=True)
        seq = Sequence(request_id=f"draft-{i}", prompt_ids=list(prompt),
                       params=params or SamplingParams(max_tokens=48, temperature=0.0), sink=lambda out: None,
                       matcher=matcher, backend=impl)
        engine.add_request(seq)
        seqs.append(seq)
    run_until_done(engine, seqs, max_steps=400)
    return seqs


SPECS: list[GrammarSpec | None] = [
    None,
    GrammarSpec.json_schema({"type": "object", "required": ["name", "city"],
                             "properties": {"name": {"type": "string", "minLength": 12, "maxLength": 30},
                                            "city": {"type": "string", "minLength": 6, "maxLength": 20}}}),
    GrammarSpec.regex(r"[a-zA-Z ,.:]{20,40}"),
    GrammarSpec.choice(["Ada Lovelace, London", "Ada Lovelace, Paris", "Charles Babbage"]),
    GrammarSpec.lark('start: "name: " /[A-Za-z ]{8,20}/ ", year: " /[0-9]{4}/'),
]


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_greedy_answers_are_the_same_with_and_without_drafts(
    loaded: LoadedModel, cache: GrammarCache, backend: str
) -> None:
    plain = generate(loaded, cache, SPECS, backend, drafts=0)
    drafted = generate(loaded, cache, SPECS, backend, drafts=8)
    for spec, off, on in zip(SPECS, plain, drafted, strict=True):
        label = spec.source if spec is not None else "free text"
        assert on.output_ids == off.output_ids, label
        assert on.finish_reason == off.finish_reason, label
        assert on.error is None, on.error
        assert off.drafting.proposed == 0
    # Drafts were fed and kept (else this compared two plain runs), and they saved steps.
    assert sum(s.drafting.accepted for s in drafted) > 0
    assert sum(len(s.stats.forward_ms) for s in drafted) < sum(len(s.stats.forward_ms) for s in plain)


@pytest.mark.parametrize("spec", [SPECS[0], SPECS[1]], ids=["free", "json"])
def test_a_row_alone_gives_the_same_answer_as_in_a_batch_of_drafting_rows(
    loaded: LoadedModel, cache: GrammarCache, spec: GrammarSpec | None
) -> None:
    alone = generate(loaded, cache, [spec], "llguidance", drafts=0)[0]
    batch = generate(loaded, cache, [spec, *SPECS], "llguidance", drafts=8)[0]
    assert batch.output_ids == alone.output_ids


@pytest.mark.parametrize(
    "params",
    [SamplingParams(max_tokens=32, temperature=0.8, seed=7), SamplingParams(max_tokens=32, temperature=0.0,
                                                                            logprobs=True),
     SamplingParams(max_tokens=32, temperature=0.0, drafts=False),
     SamplingParams(max_tokens=32, temperature=0.0, repetition_penalty=1.2)],
    ids=["sampled", "logprobs", "request-off", "penalised"],
)
def test_rows_whose_pick_is_not_the_best_logit_or_that_ask_not_to_never_draft(
    loaded: LoadedModel, cache: GrammarCache, params: SamplingParams
) -> None:
    """A sampled row's distribution, a row's reported logprobs and a penalised pick are untouched: no drafts."""
    seq = generate(loaded, cache, [None], "llguidance", drafts=8, params=params)[0]
    assert seq.drafting.proposed == 0 and seq.drafting.drafts == 0


def test_ngram_index_finds_the_latest_continuation_and_rebuilds_after_a_revision() -> None:
    index = NgramIndex()
    index.sync([1, 2, 3, 9, 1, 2, 3, 7])
    assert index.continuation([5, 2, 3]) == 7  # (2, 3) last followed at index 7: token 7
    assert index.token(7) == 7
    assert index.continuation([1, 2, 3]) == 7
    assert index.continuation([8, 8]) is None
    index.sync([1, 2, 3, 9, 1, 2, 3, 7, 1, 2])  # grown: (7, 1) and (1, 2) at the end are indexed
    assert index.continuation([7, 1]) == 9
    index.sync([1, 2, 4])  # shorter: a revision took tokens back; the index starts over
    assert index.continuation([1, 2]) == 2
    assert index.continuation([2, 3]) is None


def test_a_draft_is_cut_where_the_grammar_refuses_it_carries_forced_tokens_and_leaves_the_matcher_as_it_was(
    loaded: LoadedModel, cache: GrammarCache
) -> None:
    tok = loaded.tokenizer
    spec = GrammarSpec.json_schema({"type": "object", "required": ["city", "zip"], "additionalProperties": False,
                                    "properties": {"city": {"type": "string"}, "zip": {"type": "string"}}})
    compiled = cache.compile(spec, "llguidance")
    matcher = cache.backends.get(compiled.backend).new_matcher(compiled.compiled)
    source = tok.encode('The record:\n{"city": "London", "zip": "N1"} and more', add_special_tokens=False)
    start = next(i for i in range(len(source)) if tok.decode(source[i:]).startswith('{"city'))
    answer = source[start : start + 3]  # the answer so far copies the record's first tokens
    for token in answer:
        assert matcher.accept_token(token)
    before = allocate_bitmask(1, loaded.vocab_size)
    matcher.fill_bitmask(before, 0)
    index = NgramIndex()
    context = [*source, *answer]
    index.sync(context)
    draft = propose(index, context, 15, matcher, frozenset(loaded.stop_token_ids), 100)
    text = tok.decode(answer + draft.tokens)
    assert text == '{"city": "London", "zip": "N1"}', text  # past the object's end the grammar refuses the copy
    # After "London" and its closing quote the grammar dictates `, "zip": "`: in the draft, marked as its own.
    forced = tok.decode([t for t, own in zip(draft.tokens, draft.forced, strict=True) if own])
    assert '"zip' in forced, forced
    after = allocate_bitmask(1, loaded.vocab_size)
    matcher.fill_bitmask(after, 0)
    assert bool((before == after).all())


def test_each_row_drafts_only_as_far_as_it_pays() -> None:
    # A step of 1 token at 100 ms: cheap draft tokens and a good rate pay; a costly token or a poor rate does not.
    def line(per_token: float, first: float = 0.0) -> Callable[[int], float]:
        return lambda n: 100.0 + (first if n else 0.0) + per_token * n

    assert best_length(0.9, 8, line(5.0), 1.0) == 8
    assert best_length(0.9, 8, line(5.0, first=1000.0), 1.0) == 0  # a costly first draft place: not worth it
    assert best_length(0.9, 8, line(200.0), 1.0) == 0
    assert best_length(0.1, 8, line(60.0), 1.0) == 0
    assert 0 < best_length(0.7, 8, line(30.0), 1.0) < 8
    # A staircase (a kernel that takes 4 rows at a time): 2 and 3 tokens cost what 4 do, so 3 guesses, not 1.
    stairs = [90.0, 146.0, 172.0, 146.0, 177.0, 213.0, 240.0, 251.0, 330.0]
    assert best_length(0.75, 8, lambda n: stairs[n], 1.0) == 3
    counts = DraftCounts()
    for _ in range(10):
        counts.record(4, 0)
    poor = counts.rate
    assert poor < 0.25
    for _ in range(150):
        counts.idle()
    assert counts.rate > 0.45  # evidence ages: a row that drafted badly tries again later


def _record(cost: StepCost, times: int, *steps: tuple[StepShape, float]) -> None:
    """Each (shape, ms) recorded `times` times over, in turn."""
    for _ in range(times):
        for shape, ms in steps:
            cost.record(shape, ms)


def _recorded(times: int, *steps: tuple[StepShape, float]) -> StepCost:
    cost = StepCost()
    _record(cost, times, *steps)
    return cost


def test_step_cost_fit_reads_each_part_of_a_step() -> None:
    cost = StepCost()
    for tokens in range(1, 9):
        for dense in (1, 2, 4):
            for places in (0, 3):
                for rows in (1, 2):
                    shape = StepShape(tokens, dense, places, rows)
                    jump = 6.0 if dense > 1 else 0.0
                    for _ in range(2):  # a shape's first step is not counted (it built the shape's graphs)
                        cost.record(shape, 20.0 + 3.0 * tokens + 10.0 * dense + 0.5 * places + 1.0 * rows + jump)
    parts = cost.parts()
    assert parts.fixed == pytest.approx(20.0, rel=0.15)
    assert parts.per_token == pytest.approx(3.0, rel=0.15)
    assert parts.per_dense_row == pytest.approx(10.0, rel=0.15)
    assert parts.per_place == pytest.approx(0.5, rel=0.3)
    assert parts.per_row == pytest.approx(1.0, rel=0.3)
    assert parts.multi_row == pytest.approx(6.0, rel=0.3)
    assert parts.step_ms(StepShape(2, 1, 0, 1)) == pytest.approx(37.0, rel=0.05)


def test_a_draft_is_priced_from_the_step_without_it_and_what_a_guess_was_measured_to_add() -> None:
    """Plain decode steps at c1 and c8 (their fed tokens, dense rows and rows move together, so the line cannot
    tell which part costs what) and drafted steps of one row only, as in Gemma 3's extraction through `corral
    serve`. A draft length not measured at one row costs the plain step plus its guesses at the measured rate; at 8
    rows, where no drafted step was measured, each guess is priced at GUESS_PRIOR of the step, so no draft pays."""
    cost = _recorded(60, (StepShape(1, 1, 0, 1), 13.6), (StepShape(8, 8, 0, 8), 46.0))
    _record(cost, 6, (StepShape(3, 3, 2, 1), 30.0))
    parts = cost.parts()
    assert parts.per_guess[1] == pytest.approx(8.2, rel=0.05)
    assert parts.step_ms(StepShape(5, 5, 4, 1)) == pytest.approx(13.6 + 4 * 8.2, rel=0.05)
    assert parts.step_ms(StepShape(9, 9, 1, 8)) == pytest.approx(46.0 * (1 + GUESS_PRIOR), rel=0.05)
    assert best_length(0.95, 8, lambda n: parts.step_ms(StepShape(8 + n, 8 + n, n, 8)), 8.0) == 0
    # At one row, where guesses were measured at 8.2 ms against a 13.6 ms step, copies kept 9 times in 10 pay.
    assert best_length(0.9, 8, lambda n: parts.step_ms(StepShape(1 + n, 1 + n, n, 1)), 1.0) > 0


def test_step_cost_keeps_what_each_count_of_fed_tokens_costs_off_the_line() -> None:
    """A kernel that takes 4 rows at a time: 2 and 3 tokens cost what 4 do. The fit's line cannot show it; the
    per-count differences do, so a step of 4 reads cheaper than one of 3."""
    measured = {1: 90.0, 2: 146.0, 3: 172.0, 4: 146.0, 5: 177.0, 6: 213.0, 8: 251.0}
    cost = StepCost()
    for _ in range(20):
        for tokens, ms in measured.items():
            cost.record(StepShape(tokens, 1, tokens - 1, 1), ms)
    parts = cost.parts()
    for tokens, ms in measured.items():
        assert parts.step_ms(StepShape(tokens, 1, tokens - 1, 1)) == pytest.approx(ms, rel=0.1), tokens
    assert parts.step_ms(StepShape(4, 1, 3, 1)) < parts.step_ms(StepShape(3, 1, 2, 1))


def test_a_step_of_many_rows_does_not_read_the_cost_of_one_row_feeding_as_many_tokens() -> None:
    """Drafted steps of one row (9 tokens in ~30 ms, as Gemma 3's stream at c1) and plain steps of 8 rows (8 tokens,
    ~47 ms): a draft at c8 (9 tokens over 8 rows) is not priced as the cheap one-row step of 9 tokens, so it costs
    more than the plain c8 step, and the one-row steps keep their own measured cost."""
    cost = StepCost()
    for _ in range(40):
        cost.record(StepShape(1, 1, 0, 1), 16.0)
        cost.record(StepShape(9, 9, 8, 1), 30.0)
        cost.record(StepShape(8, 8, 0, 8), 47.0)
    parts = cost.parts()
    plain_c8 = parts.step_ms(StepShape(8, 8, 0, 8))
    assert plain_c8 == pytest.approx(47.0, rel=0.1)
    assert parts.step_ms(StepShape(9, 9, 8, 1)) == pytest.approx(30.0, rel=0.1)
    assert parts.step_ms(StepShape(9, 9, 1, 8)) > plain_c8
    assert best_length(0.6, 8, lambda n: parts.step_ms(StepShape(8 + n, 8 + n, n, 8)), 8.0) == 0


def test_a_drafted_step_does_not_read_the_cost_of_a_plain_step_feeding_as_many_tokens() -> None:
    """A plain step of one row and 2 tokens (the pick and a grammar's forced token: one logit row) and a drafted one
    (a guess: two logit rows, a head apart from the decoder's graph) cost 12 and 25 ms, as on Gemma 3 270M through
    `corral serve`; the fit's line (a ridge towards its prior) need not tell them apart, the staircase must. Averaged
    together, a draft of one guess read ~19 ms and looked worth feeding at a rate a 25 ms step does not repay."""
    cost = StepCost()
    for _ in range(40):
        cost.record(StepShape(1, 1, 0, 1), 13.6)
        cost.record(StepShape(2, 1, 0, 1), 12.3)
        cost.record(StepShape(2, 2, 1, 1), 25.5)
        # What else the server ran, which the line is fitted to as well: prompts, and steps of 8 rows.
        cost.record(StepShape(40, 1, 0, 1), 150.0)
        cost.record(StepShape(8, 8, 0, 8), 47.0)
        cost.record(StepShape(16, 8, 0, 8), 70.0)
    parts = cost.parts()
    assert parts.step_ms(StepShape(2, 1, 0, 1)) == pytest.approx(12.3, rel=0.1)
    assert parts.step_ms(StepShape(2, 2, 1, 1)) == pytest.approx(25.5, rel=0.1)
    # 1 + 0.8 expected tokens in 25.5 ms is fewer per ms than 1 in 13.6: no draft.
    assert best_length(0.8, 1, lambda n: parts.step_ms(StepShape(1 + n, 1 + n, n, 1)), 1.0) == 0


def test_a_shapes_first_step_which_built_its_graphs_is_not_its_cost() -> None:
    """Gemma 3 270M at one row: a draft of 4 guesses took 88.9 ms the first time (its graphs built) and ~48 after,
    against 14 for a plain step. Counted, the cold step alone would price a guess at 19 ms and stop the row
    drafting before a warm step was seen; a guess is priced at what warm steps show."""
    cost = StepCost()
    for _ in range(40):
        cost.record(StepShape(1, 1, 0, 1), 14.0)
    cost.record(StepShape(5, 5, 4, 1), 88.9)
    assert 1 not in cost.parts().per_guess  # nothing drafted counted yet: the prior
    cost.record(StepShape(5, 5, 4, 1), 48.0)
    assert cost.parts().per_guess[1] == pytest.approx((48.0 - 14.0) / 4, rel=0.05)


def test_step_cost_remembers_what_drafts_cost_after_many_steps_without_one() -> None:
    """Where a fed token costs a whole step (Qwen2.5 on 2 AMD EPYC cores), a few drafted steps teach the fit so; a
    few requests without drafts (hundreds of plain steps) must not make it forget and draft at a loss again."""
    cost = _recorded(6, (StepShape(2, 2, 1, 1), 200.0), (StepShape(3, 3, 2, 1), 300.0))
    _record(cost, 1000, (StepShape(1, 1, 0, 1), 100.0))
    parts = cost.parts()
    assert parts.step_ms(StepShape(1, 1, 0, 1)) == pytest.approx(100.0, rel=0.05)
    assert parts.step_ms(StepShape(2, 2, 1, 1)) == pytest.approx(200.0, rel=0.1)
    assert best_length(0.8, 8, lambda n: parts.step_ms(StepShape(1 + n, 1 + n, n, 1)), 1.0) == 0


def test_step_cost_forgets_drafted_steps_too_old_to_tell() -> None:
    """A drafted step is measured only when a row drafts: a few slow ones (a busy machine, a cold start) must not
    keep every row from drafting for as long as the server runs. Past COST_MAX_AGE steps they are forgotten, the
    fit reads its prior, and a row whose guesses keep drafts again (and so measures drafted steps anew)."""
    cost = StepCost()
    for _ in range(8):
        cost.record(StepShape(4, 4, 3, 1), 1500.0)  # cold: 15 times a plain step
    for _ in range(200):
        cost.record(StepShape(1, 1, 0, 1), 100.0)

    def length() -> int:
        parts = cost.parts()
        return best_length(0.9, 3, lambda n: parts.step_ms(StepShape(1 + n, 1 + n, n, 1)), 1.0)

    assert length() == 0
    for _ in range(COST_MAX_AGE):
        cost.record(StepShape(1, 1, 0, 1), 100.0)
    assert length() > 0


def test_step_cost_refits_every_few_steps_and_at_the_first_drafted_one() -> None:
    """The fit costs milliseconds of Python: it is made again every REFIT_EVERY steps, not every step, except
    that the first drafted step counted is read at once (until then the fit guesses drafts' cost from its prior).
    A shape's very first step is not counted: it built the shape's graphs."""
    cost = StepCost()
    for _ in range(50):
        cost.record(StepShape(1, 1, 0, 1), 100.0)
    plain = cost.parts()
    for _ in range(REFIT_EVERY - 1):
        cost.record(StepShape(1, 1, 0, 1), 200.0)
    assert cost.parts() is plain
    cost.record(StepShape(1, 1, 0, 1), 200.0)
    refitted = cost.parts()
    assert refitted.step_ms(StepShape(1, 1, 0, 1)) > plain.step_ms(StepShape(1, 1, 0, 1)) + 20
    guessed = refitted.step_ms(StepShape(4, 4, 3, 1))
    cost.record(StepShape(4, 4, 3, 1), 9000.0)  # a shape's first step builds its graphs: not counted
    assert cost.parts() is refitted
    cost.record(StepShape(4, 4, 3, 1), 5000.0)
    assert cost.parts().step_ms(StepShape(4, 4, 3, 1)) > guessed + 100


def _json_matcher(loaded: LoadedModel, cache: GrammarCache, properties: list[str]) -> tuple[Matcher, GrammarSpec]:
    spec = GrammarSpec.json_schema({"type": "object", "required": properties, "additionalProperties": False,
                                    "properties": {p: {"type": "string"} for p in properties}})
    compiled = cache.compile(spec, "llguidance")
    return cache.backends.get(compiled.backend).new_matcher(compiled.compiled), spec


def _prompt_text(loaded: LoadedModel) -> PromptText:
    tok = loaded.tokenizer
    return PromptText(lambda t: str(tok.decode([t])), lambda s: list(tok.encode(s, add_special_tokens=False)),
                      lambda ids: str(tok.decode(ids)))


def test_under_a_grammar_punctuation_alone_does_not_guess_the_next_value(
    loaded: LoadedModel, cache: GrammarCache
) -> None:
    """After `", "zip": "` an answer starts a new value: what followed `": "` earlier (the city) is no guess for it.
    Without the grammar rule the lookup proposes it; with it, nothing, so no forward position is spent on it."""
    tok = loaded.tokenizer
    matcher, _ = _json_matcher(loaded, cache, ["city", "zip"])
    prompt = tok.encode("Where does Ada live? Reply in JSON.", add_special_tokens=False)
    answer = tok.encode('{"city": "London", "zip": "', add_special_tokens=False)
    for token in answer:
        assert matcher.accept_token(token)
    index = NgramIndex()
    context = [*prompt, *answer]
    index.sync(context)
    stops = frozenset(loaded.stop_token_ids)
    plain = propose(index, context, 4, matcher, stops, 100)
    assert tok.decode(plain.tokens).startswith("London"), tok.decode(plain.tokens)
    text = _prompt_text(loaded)
    index.prompt_text = text.decode(prompt)
    assert propose(index, context, 4, matcher, stops, 100, text, len(answer)).tokens == []


def test_a_copy_that_starts_inside_a_prompt_token_is_found_by_its_text(
    loaded: LoadedModel, cache: GrammarCache
) -> None:
    """The answer's value began with its own tokens (after its quote), not the prompt's: the token lookup finds
    nothing, the text lookup finds the rest of the value in the prompt, cut where the grammar refuses it."""
    tok = loaded.tokenizer
    matcher, _ = _json_matcher(loaded, cache, ["company"])
    prompt = tok.encode("I write on behalf of Northwind Traders AB, Stockholm.", add_special_tokens=False)
    answer = tok.encode('{"company": "Northw', add_special_tokens=False)
    for token in answer:
        assert matcher.accept_token(token)
    text = _prompt_text(loaded)
    index = NgramIndex()
    context = [*prompt, *answer]
    index.sync(context)
    index.prompt_text = text.decode(prompt)
    draft = propose(index, context, 8, matcher, frozenset(loaded.stop_token_ids), 100, text, len(answer))
    assert tok.decode(answer + draft.tokens).startswith('{"company": "Northwind Traders AB'), tok.decode(draft.tokens)
    assert text.guesses(index.prompt_text, tok.encode('{"company": "Xq', add_special_tokens=False), 8) == []


def test_a_row_that_feeds_no_draft_measures_its_rate_from_shadows_at_no_cost() -> None:
    """Probes fed to measure a row's acceptance cost Qwen2.5's text that copies nothing 5-9 % of its speed. A row
    that does not draft now keeps the draft it would have fed as a shadow and scores it against its answer: the
    rate moves, no guess is fed, and once the shadows keep and drafts are cheap the row drafts."""
    spec = Speculation(8, frozenset(), None, 16, 512, 32)
    costly = CostParts(10.0, 1000.0, 0.0, 0.0, 0.1, guess_share=100.0)
    spec.cost.parts = lambda: costly  # type: ignore[method-assign]
    prompt = [1, 2, 3, 4, 5, 6, 7, 8] * 2
    seq = Sequence(request_id="shadow", prompt_ids=prompt, params=SamplingParams(max_tokens=64, temperature=0.0),
                   sink=lambda out: None)

    def answer(*made: int) -> None:
        """The model's tokens appended as a step makes them: the last one pending, the rest in the cache."""
        seq.output_ids.extend(made)
        seq.num_cached, seq.pending = len(prompt) + len(seq.output_ids) - 1, seq.output_ids[-1:]

    def step(*made: int) -> None:
        spec.prepare([seq])
        assert seq.draft is None  # a draft costs 1000 ms a token here: never fed
        answer(*made)

    answer(1, 2)
    step(3)
    assert seq.shadow is not None and seq.shadow.tokens[:3] == [3, 4, 5]
    step(4)
    # The answer follows the shadow: its kept guesses count as they come, the shadow goes on.
    assert seq.shadow is not None and seq.drafting.shadows == 0 and seq.drafting.kept > 0.9
    followed = seq.drafting.rate
    assert followed > 0.5
    step(9)  # ...then leaves it after two kept guesses: a refusal, and the shadow ends
    step(5)
    assert seq.drafting.shadows == 1 and seq.drafting.proposed == seq.drafting.drafts == 0
    assert 1.5 < seq.drafting.kept <= 2.0 and seq.drafting.refused > 0.9  # two kept, one refusal (aged a step)
    assert seq.drafting.rate < followed
    poor = seq.drafting.rate
    step(6)  # 9 is not in the prompt: no lookup until the answer copies again
    for _ in range(6):  # text that copies its prompt: each shadow kept whole
        start = len(seq.output_ids)
        spec.prepare([seq])
        assert seq.shadow is not None and seq.shadow.start == start
        answer(*seq.shadow.tokens)
    spec.prepare([seq])
    assert seq.drafting.shadows == 7 and seq.drafting.rate > max(poor, 0.9)
    cheap = CostParts(100.0, 1.0, 0.0, 0.0, 0.1, guess_share=0.01)
    spec.cost.parts = lambda: cheap  # type: ignore[method-assign]
    spec.prepare([seq])
    assert seq.draft is not None and len(seq.draft) == 8 and seq.shadow is None


def test_a_new_row_starts_from_its_kinds_recent_drafts() -> None:
    fresh = DraftCounts()
    KindHistory().seed(fresh)  # nothing seen yet: the even prior
    assert fresh.rate == 0.5
    plain = KindHistory()
    for _ in range(20):  # free text that copies nothing: every draft and shadow misses
        plain.record(proposed=3, accepted=0)
    row = DraftCounts()
    plain.seed(row)
    assert row.rate < 0.25
    copying = KindHistory()
    for _ in range(20):  # extraction: most guesses kept
        copying.record(proposed=4, accepted=4)
    row = DraftCounts()
    copying.seed(row)
    # Good history does not raise a row above the even prior: its steps may be batched, where drafts cost more.
    assert row.rate == 0.5
    row = DraftCounts()
    plain.seed(row)
    assert row.kept + row.refused <= 4.0 + 1e-9  # a few drafts' worth: the row's own drafts soon outweigh it


def test_a_lone_row_whose_guesses_keep_measures_a_long_draft_priced_from_short_ones() -> None:
    """Drafted steps of one guess priced every guess at more than a plain step (Gemma 3's head of 2 rows costs 2.6
    times one row's), so a row copying its prompt never fed the long drafts that pay. A lone row whose guesses are
    kept feeds its longest draft until EXPLORE_STEPS steps of that shape are measured, then the price decides."""
    from corral.server.engine.speculation import EXPLORE_STEPS

    spec = Speculation(8, frozenset(), None, 16, 512, 32)
    linear = CostParts(11.0, 0.0, 0.0, 0.0, 0.0, per_guess={1: 13.7})  # measured from 1-guess drafts
    spec.cost.parts = lambda: linear  # type: ignore[method-assign]
    prompt = list(range(1, 21)) * 2
    seq = Sequence(request_id="copy", prompt_ids=prompt, params=SamplingParams(max_tokens=64, temperature=0.0),
                   sink=lambda out: None)
    seq.output_ids.extend([1, 2])
    seq.num_cached, seq.pending = len(prompt) + 1, [2]
    spec.prepare([seq])
    assert seq.draft is None  # an even rate: not worth exploring
    seq.drafting.kept, seq.drafting.refused = 20.0, 0.0  # its guesses kept
    long_shape = StepShape(1 + 8, 9, 8, 1)
    for measured in range(EXPLORE_STEPS + 1):
        spec.prepare([seq])
        assert seq.draft is not None and len(seq.draft) == 8, measured
        spec.cost.record(long_shape, 40.0)  # the first of a shape is not kept: EXPLORE_STEPS + 1 steps in all
    spec.prepare([seq])
    assert seq.draft is None  # measured now; the (mocked) price still says it does not pay
    batch = Sequence(request_id="other", prompt_ids=prompt, params=SamplingParams(max_tokens=64, temperature=0.0),
                     sink=lambda out: None)
    batch.output_ids.extend([1, 2])
    batch.num_cached, batch.pending = len(prompt) + 1, [2]
    spec.cost = StepCost()
    spec.cost.parts = lambda: CostParts(11.0, 0.0, 0.0, 0.0, 0.0, per_guess={2: 13.7})  # type: ignore[method-assign]
    spec.prepare([batch])  # its first chance seeds its tallies
    seq.drafting.kept, batch.drafting.kept = 20.0, 20.0
    spec.prepare([seq, batch])
    assert seq.draft is None and batch.draft is None  # in a batch a guess costs what a step does: no exploring
