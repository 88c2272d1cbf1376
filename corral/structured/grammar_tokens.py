"""Tokens the grammar writes rather than the model: jump-forward (what the grammar dictates next) and the
completion that closes an answer early (corral/structured/answer_closing.py). Both go through the matcher, so
they are in the grammar by construction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable

from corral.grammar_engines.protocol import Matcher
from corral.server.engine.drafting import forced_run
from corral.server.engine.logprobs import TokenLogprob
from corral.server.engine.output_stage import OutputStage
from corral.server.engine.sequence import Sequence
from corral.structured.answer_closing import (
    ITEM_PERIOD,
    MARGIN,
    RUNAWAY_DIGITS,
    RUNAWAY_REPEATS,
    AnswerCloser,
    ClosedBecause,
    trailing_digits,
)
from corral.structured.closing import ClosingVocabulary

# Openings kept (grammar, backend, room, keys, examples). An app sends the same schema again and again, and its
# opening search held up the engine thread for every request, every row of the batch waiting on it (measured:
# docs/measured-choices.md#closing-answers).
OPENINGS_KEPT = 512


class GrammarTokens:
    def __init__(self, vocab: ClosingVocabulary, stop_ids: frozenset[int], *, jump_forward: bool) -> None:
        self.vocab = vocab
        self.stop_ids = stop_ids
        self.jump_forward = jump_forward
        self._openings: OrderedDict[Hashable, list[int]] = OrderedDict()

    def closer_for(self, seq: Sequence, room: int) -> AnswerCloser | None:
        """The closing state of a closable answer about to start with `room` tokens to go."""
        if not seq.closable or seq.matcher is None:
            return None
        closer = AnswerCloser(self.vocab, seq.required_keys, seq.pattern_examples)
        if closer.due(room):
            closer.seed(self._opening(seq, closer, room), room)
        return closer

    def _opening(self, seq: Sequence, closer: AnswerCloser, room: int) -> list[int] | None:
        """The grammar's shortest answer from the start, searched once per grammar, backend (the contract
        guard's matcher refuses more), room and schema keys. Only found ones are kept: a miss may be the
        search's deadline on a busy machine, and the next request of that grammar searches again."""
        assert seq.matcher is not None
        grammar = seq.grammar
        # The spec and the engine that compiled it name the grammar (and hold no compiled tables alive).
        key = (grammar.spec, grammar.backend_name, seq.backend, room, closer.keys, closer.examples) if grammar else None
        if key is not None and key in self._openings:
            self._openings.move_to_end(key)
            return self._openings[key]
        opening = closer.opening(seq.matcher, room)
        if key is not None and opening is not None:
            self._openings[key] = opening
            if len(self._openings) > OPENINGS_KEPT:
                self._openings.popitem(last=False)
        return opening

    def forced_after(self, seq: Sequence) -> list[int]:
        """Jump-forward: the tokens the grammar dictates next, accepted into the matcher (within max_tokens)."""
        if seq.matcher is None or not self.jump_forward:
            return []
        forced = forced_run(seq.matcher, self.stop_ids, seq.params.max_tokens - len(seq.output_ids) - 1)
        seq.stats.forced_tokens += len(forced)
        return forced

    def close(
        self, seq: Sequence, room: int, output: OutputStage, chosen: list[bool], *, stalled: bool = False
    ) -> bool:
        """Append the grammar's shortest completion to a closable answer when it must close: a runaway at once
        (`stalled` by the watchdog's loop check, a repeated block, a number past any plausible width), a budget
        about to run out once the completion would no longer fit after another step. True: closed (the caller
        ends the sequence). `chosen`: which of the tokens just appended the model chose."""
        closer, matcher = seq.closer, seq.matcher
        if closer is None or matcher is None:
            return False
        closer.record(len(seq.output_ids), chosen)
        if matcher.is_terminated():
            return False

        def text() -> str:  # decoded only when a search runs
            return output.decode(seq.output_ids)

        plan = self._runaway_plan(seq, closer, matcher, room, output, text, stalled)
        why = ClosedBecause.RUNAWAY
        if plan is None:
            decided = closer.plan_if_due(matcher, room, len(seq.output_ids), text)
            if decided is None:
                return False
            at, plan = decided
            if at < len(seq.output_ids) and self._take_back(seq, len(seq.output_ids) - at, output.decode) is None:
                return False
            why = ClosedBecause.BUDGET
        if plan is None:
            return False
        for index, token in enumerate(plan):
            if not matcher.accept_token(token):  # the search accepted it from this very state
                matcher.rollback(index)
                return False
        seq.output_ids.extend(plan)
        if seq.params.logprobs:  # the grammar's completion, not the model's choice: recorded as forced
            seq.logprobs += [TokenLogprob.forced(t, seq.params.top_logprobs) for t in plan]
        seq.stats.closing_tokens = len(plan)
        closer.closed = why
        return True

    def _runaway_plan(
        self,
        seq: Sequence,
        closer: AnswerCloser,
        matcher: Matcher,
        room: int,
        output: OutputStage,
        text: Callable[[], str],
        stalled: bool,
    ) -> list[int] | None:
        """The completion that ends a runaway, if the answer is one: the watchdog's stall, a number past any
        plausible width, or a repeated block whose completion costs no more than one more repeat (so nesting
        the schema requires, 32 levels of the same model, is not cut: its completion is the rest of it)."""
        period = closer.runaway_period(seq.output_ids, output.token_text)
        # Digits inside a string count too: Gemma 3 wrote `"1234567890123…"` ids until max_tokens (a cycle of ten
        # one-digit tokens, whose completion was too long for the repeated-block rule to take).
        wide = trailing_digits(seq.output_ids, output.token_text) > RUNAWAY_DIGITS
        if not (stalled or period or wide):
            return None
        taken: tuple[list[int], list[TokenLogprob]] | None = None
        if period >= ITEM_PERIOD:  # whole items repeated: keep the first, take back the copies
            taken = self._take_back(seq, (RUNAWAY_REPEATS - 1) * period, output.decode)
        at = len(seq.output_ids)
        plan = closer.plan_now(matcher, room + (len(taken[0]) if taken else 0), at, text, last_chance=stalled)
        if plan is not None and not (stalled or wide) and len(plan) > max(period, MARGIN):
            plan = None
            closer.hold_off(at)  # the repetition may be the schema's; if not, the stall watchdog ends it
        if plan is None and taken is not None:  # not closing here after all: the answer goes on as it was
            self._put_back(seq, *taken)
        return plan

    @staticmethod
    def _take_back(
        seq: Sequence, count: int, decode: Callable[[list[int]], str]
    ) -> tuple[list[int], list[TokenLogprob]] | None:
        """Drop the last `count` output tokens from the answer and its matcher; they are returned for
        `_put_back`. The sequence is about to end, so its KV cache needs no rewind. None (nothing done) if
        part of them was already streamed to the client."""
        keep = len(seq.output_ids) - count
        if seq.matcher is None or keep < 0 or (seq.emitted and seq.emitted > len(decode(seq.output_ids[:keep]))):
            return None
        seq.matcher.rollback(count)
        taken = (seq.output_ids[keep:], seq.logprobs[keep:])
        del seq.output_ids[keep:]
        del seq.logprobs[keep:]
        return taken

    @staticmethod
    def _put_back(seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob]) -> None:
        """Undo `_take_back`: the matcher accepted these tokens from this state a moment ago."""
        for token in tokens:
            if seq.matcher is None or not seq.matcher.accept_token(token):
                raise RuntimeError("the grammar refused tokens it had accepted")
        seq.output_ids.extend(tokens)
        seq.logprobs.extend(logprobs)
