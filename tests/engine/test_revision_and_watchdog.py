"""Revision correctness (KV, matcher, output) and the in-loop watchdog, driven through the real Engine."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
from conftest import TOKENIZER_FAMILIES, run_until_done

from corral.grammar_engines.compilation import GrammarCache
from corral.grammar_engines.protocol import TokenizerSpec, allocate_bitmask
from corral.grammar_engines.registry import BackendSet
from corral.grammars.spec import GrammarSpec
from corral.server.engine import Engine, EngineConfig, SamplingParams, SeqOutput
from corral.server.engine import Sequence as Seq
from corral.server.engine.model_runner import DecodedStep, ForwardRow, ModelRunner, StepLogits
from corral.server.models import LoadedModel, load_model
from corral.structured.watchdog import Trip, WatchdogLimits


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model("corral-tiny", device="cpu")


@pytest.fixture(scope="module")
def backends(loaded: LoadedModel) -> BackendSet:
    return BackendSet(TokenizerSpec(loaded.tokenizer, loaded.vocab_size, loaded.stop_token_ids))


def make_engine(loaded: LoadedModel, **overrides: Any) -> Engine:
    config = EngineConfig(max_batch=4, max_model_len=512, revision_token_id=loaded.revision_token_id, **overrides)
    return Engine(loaded, config)


def new_seq(loaded: LoadedModel, rid: str, **params: Any) -> tuple[Seq, list[SeqOutput]]:
    outputs: list[SeqOutput] = []
    prompt = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"hi {rid}"}], add_generation_prompt=True, tokenize=True
    )
    if isinstance(prompt, dict) or hasattr(prompt, "input_ids"):
        prompt = prompt["input_ids"]
    seq = Seq(
        request_id=rid,
        prompt_ids=[int(t) for t in prompt],
        params=SamplingParams(**{"temperature": 0.0, **params}),
        sink=outputs.append,
    )
    return seq, outputs


def fresh_logits(loaded: LoadedModel, tokens: list[int]) -> torch.Tensor:
    runner = ModelRunner(loaded, max_batch=1, max_len=512)
    with torch.inference_mode():
        return runner.forward([ForwardRow(0, 0, tokens)])[0]


def test_revision_restores_kv_cache_matcher_and_output(loaded: LoadedModel, backends: BackendSet) -> None:
    engine = make_engine(loaded)
    cache = GrammarCache(backends)
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
        "required": ["a", "b"],
    }
    compiled = cache.compile(GrammarSpec.json_schema(schema), "llguidance")
    backend = backends.get("llguidance")
    seq, _ = new_seq(loaded, "rev", max_tokens=64, temperature=0.0)
    seq.matcher, seq.backend = backend.new_matcher(compiled.compiled), backend
    engine.add_request(seq)
    for _ in range(4):
        engine.step()
    assert len(seq.revision.units) >= 3 and not seq.is_finished
    before = list(seq.output_ids)
    engine._revise(seq, Trip.DEAD_END)  # the same path a sampled revision token takes
    kept = list(seq.output_ids)
    removed = before[len(kept) :]
    assert removed and before[: len(kept)] == kept

    # Matcher: equal to a fresh matcher fed the kept tokens (same mask).
    fresh = backend.new_matcher(compiled.compiled)
    for token in kept:
        assert fresh.accept_token(token)
    masks = allocate_bitmask(2, loaded.vocab_size)
    backend.fill_bitmasks([seq.matcher, fresh], masks, [0, 1])
    assert torch.equal(masks[0], masks[1])

    # KV cache: the next forward's logits equal a fresh prefill of prompt + kept tokens.
    captured: list[torch.Tensor] = []
    original = engine.runner.head

    def spy(step: DecodedStep, allowed: object = None) -> StepLogits:
        out = original(step)  # no restricted head: the whole row is compared with a fresh prefill
        captured.append(out.rows.clone())
        return out

    engine.runner.head = spy  # type: ignore[method-assign]
    engine.step()
    expected = fresh_logits(loaded, seq.prompt_ids + kept)
    torch.testing.assert_close(captured[0][0], expected, rtol=1e-4, atol=1e-4)
    # The retracted choice is banned at its position.
    assert seq.output_ids[len(kept)] != removed[0]
    run_until_done(engine, [seq])
    assert seq.finish_reason == "stop"
    assert seq.text == loaded.tokenizer.decode(seq.output_ids, skip_special_tokens=True)


def test_revision_token_depth_limit_and_stream_never_shows_retracted_text(loaded: LoadedModel) -> None:
    engine = make_engine(loaded)
    assert loaded.revision_token_id is not None
    # The model is pushed to emit the revision token whenever one is allowed.
    seq, outputs = new_seq(
        loaded,
        "depth",
        max_tokens=50,
        temperature=0.0,
        max_revisions=3,
        ignore_eos=True,
        logit_bias={loaded.revision_token_id: 100.0},
    )
    engine.add_request(seq)
    run_until_done(engine, [seq])
    assert seq.finish_reason == str(Trip.REVISION_DEPTH_EXCEEDED)
    assert seq.revision.revisions == 3
    streamed = "".join(o.delta for o in outputs)
    assert streamed == seq.text  # append-only stream: nothing shown was later taken back
    assert len(seq.output_ids) == 1  # three tokens were taken back, the fourth is kept
    banned = seq.revision.banned_at(0)
    assert len(banned) == 3 and seq.output_ids[0] not in banned


class _DeadEndMatcher:
    """Allows tokens A or B at positions 0-1 and C at position 2 — except after A at position 1, where it
    allows nothing (a dead end only backtracking can escape). Complete after three tokens."""

    def __init__(self, a: int, b: int, c: int) -> None:
        self.a, self.b, self.c = a, b, c
        self.tokens: list[int] = []

    @property
    def error(self) -> str | None:
        return None

    def _allowed(self) -> list[int]:
        if len(self.tokens) < 2:
            return [self.a, self.b]
        if len(self.tokens) == 2:
            return [] if self.tokens[1] == self.a else [self.c]
        return []

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0
        for token in self._allowed():
            word, bit = divmod(token, 32)
            value = int(bitmask[row, word]) | (1 << bit)
            bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value

    def accept_token(self, token_id: int) -> bool:
        if token_id not in self._allowed():
            return False
        self.tokens.append(token_id)
        return True

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        return 0

    def rollback(self, num_tokens: int) -> None:
        del self.tokens[len(self.tokens) - num_tokens :]

    def forced_tokens(self) -> list[int]:
        return []

    def is_terminated(self) -> bool:
        return len(self.tokens) == 3

    def can_terminate(self) -> bool:
        return len(self.tokens) == 3


class _PlainBackend:
    name = "dead-end-test"

    def fill_bitmasks(self, matchers: Sequence[Any], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        for matcher, row in zip(matchers, rows, strict=True):
            matcher.fill_bitmask(bitmask, row)


@pytest.fixture(scope="module", params=TOKENIZER_FAMILIES)
def family_model(request: pytest.FixtureRequest, loaded: LoadedModel) -> LoadedModel:
    """corral-tiny, then gemma-3-270m: a real model on Gemma's vocabulary, which has no revision token."""
    return loaded if request.param == "corral-tiny" else load_model(str(request.param), device="cpu")


@pytest.mark.parametrize(("max_revisions", "reason"), [(4, "stop"), (0, str(Trip.DEAD_END))])
def test_dead_end_backtracks_or_ends_with_dead_end(family_model: LoadedModel, max_revisions: int, reason: str) -> None:
    """Backtracking needs no revision token: on either tokenizer family a dead end takes back the last real
    choice (KV, matcher, output) and the answer goes on, or, with no revisions left, ends as `dead_end`."""
    loaded = family_model
    engine = make_engine(loaded)
    a, b, c = (loaded.tokenizer.encode(t, add_special_tokens=False)[0] for t in ("A", "B", "C"))
    seq, _ = new_seq(
        loaded,
        "dead",
        max_tokens=20,
        max_revisions=max_revisions,
        # The model walks into the dead end first and never asks for a revision itself.
        logit_bias={a: 50.0, b: -50.0, loaded.revision_token_id or 0: -100.0},
    )
    seq.matcher, seq.backend = _DeadEndMatcher(a, b, c), _PlainBackend()  # type: ignore[assignment]
    engine.add_request(seq)
    run_until_done(engine, [seq])
    assert seq.finish_reason == reason
    if reason == "stop":
        assert seq.output_ids == [a, b, c] and seq.revision.revisions == 1
    else:
        assert seq.trip == str(Trip.DEAD_END) and seq.error


@pytest.fixture()
def stall_engine(loaded: LoadedModel) -> Iterator[Engine]:
    yield make_engine(loaded, limits=WatchdogLimits(stall_whitespace_tokens=16, stall_repeat_tokens=24))


def test_whitespace_loop_is_cut_short_while_others_finish(loaded: LoadedModel, stall_engine: Engine) -> None:
    space = loaded.tokenizer.encode(" ", add_special_tokens=False)[0]
    looping, _ = new_seq(loaded, "ws", max_tokens=400, logit_bias={space: 100.0})
    ordinary, _ = new_seq(loaded, "ok", max_tokens=8)
    stall_engine.add_request(looping)
    stall_engine.add_request(ordinary)
    run_until_done(stall_engine, [looping, ordinary])
    assert looping.finish_reason == str(Trip.STALL) and len(looping.output_ids) == 16
    assert ordinary.finish_reason in ("stop", "length")


def test_repeating_cycle_is_cut_short(loaded: LoadedModel, stall_engine: Engine) -> None:
    word = loaded.tokenizer.encode("hello", add_special_tokens=False)[0]
    seq, _ = new_seq(loaded, "cycle", max_tokens=400, logit_bias={word: 100.0})
    stall_engine.add_request(seq)
    run_until_done(stall_engine, [seq])
    assert seq.finish_reason == str(Trip.STALL) and len(seq.output_ids) < 40


def test_mask_budget_overruns_end_the_request(loaded: LoadedModel) -> None:
    engine = make_engine(loaded, limits=WatchdogLimits(mask_budget_ms=0.000001, mask_overruns=2))
    a, b, c = (loaded.tokenizer.encode(t, add_special_tokens=False)[0] for t in ("A", "B", "C"))
    seq, _ = new_seq(loaded, "slow-mask", max_tokens=20, logit_bias={b: 50.0})
    seq.matcher, seq.backend = _DeadEndMatcher(a, b, c), _PlainBackend()  # type: ignore[assignment]
    engine.add_request(seq)
    run_until_done(engine, [seq])
    assert seq.finish_reason == str(Trip.MASK_TIMEOUT)
    assert len(seq.stats.mask_us) == 3  # three fills, each over budget; the third passes the limit of 2


class _ScriptedMatcher(_DeadEndMatcher):
    """Allowed tokens given by `script(prefix)`; complete once `length` tokens are in."""

    def __init__(self, script: Any, length: int) -> None:
        super().__init__(0, 0, 0)
        self.script, self.length = script, length

    def _allowed(self) -> list[int]:
        return [] if len(self.tokens) >= self.length else list(self.script(tuple(self.tokens)))

    def is_terminated(self) -> bool:
        return len(self.tokens) == self.length

    def can_terminate(self) -> bool:
        return self.is_terminated()


def _tokens(loaded: LoadedModel, *texts: str) -> list[int]:
    return [loaded.tokenizer.encode(t, add_special_tokens=False)[0] for t in texts]


def test_a_revision_of_tokens_the_grammar_dictated_is_refused(loaded: LoadedModel) -> None:
    """Seen on a random 8B model: `{"x": <number>, ...}` opens with tokens the grammar dictates; the model
    asked to revise right after them, the revision banned the only allowed first token, and the answer
    ended `dead_end` with no output. Now the revision is refused there and the answer goes on."""
    engine = make_engine(loaded)
    x, y = _tokens(loaded, "X", "Y")
    seq, _ = new_seq(loaded, "dictated", max_tokens=20, logit_bias={loaded.revision_token_id or 0: 100.0})
    seq.matcher = _ScriptedMatcher(lambda prefix: [(x, y)[len(prefix)]], 2)  # type: ignore[assignment]
    seq.backend = _PlainBackend()  # type: ignore[assignment]
    engine.add_request(seq)
    run_until_done(engine, [seq])
    assert (seq.finish_reason, seq.output_ids, seq.revision.revisions) == ("stop", [x, y], 0)
    assert loaded.revision_token_id in seq.revision.banned_at(1)  # asked for at position 1, refused there


def test_backtracking_goes_past_a_dictated_token_to_the_choice_before_it(loaded: LoadedModel) -> None:
    """A dead end after a dictated token (C) takes back C and the choice before it (A) together: one
    revision per step taken back, so what streaming already showed stays shown."""
    engine = make_engine(loaded)
    a, b, c, d = _tokens(loaded, "A", "B", "C", "D")

    def script(prefix: tuple[int, ...]) -> list[int]:
        return [[a, b], [c], [] if prefix[:1] == (a,) else [d]][len(prefix)]

    seq, _ = new_seq(loaded, "skip", max_tokens=20, max_revisions=2,
                     logit_bias={a: 50.0, b: -50.0, loaded.revision_token_id or 0: -100.0})
    seq.matcher = _ScriptedMatcher(script, 3)  # type: ignore[assignment]
    seq.backend = _PlainBackend()  # type: ignore[assignment]
    engine.add_request(seq)
    run_until_done(engine, [seq])
    assert (seq.finish_reason, seq.output_ids, seq.revision.revisions) == ("stop", [b, c, d], 2)
    assert c not in seq.revision.banned_at(1)
