"""Answers that close: when a structured answer's token budget runs low, or the model runs away, the engine
ends it with the shortest completion the grammar allows (samplers/closing.py) instead of cutting it mid-value.

When to look: a search costs a few mask fills (~1-5 ms), so it runs only once the room left (max_tokens or
the context, whichever ends first) is within `FIRST_CHECK` tokens, and after a search that found a
completion of n tokens, again once the room is within 2n + `MARGIN` (every step near the end). It closes
when the completion would leave less than `MARGIN` tokens: one more step appends a token plus any the grammar
forces, and may open a nested value that needs more to close. If a step still leaves no completion that fits
(it opened an object with required properties, say), the engine takes that step back and closes from where
the last completion was found, which still fits: that room was larger by the tokens the step added.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum

from samplers.closing import DEFAULT_DEADLINE_S, ClosingVocabulary, shortest_completion
from samplers.protocol import Matcher

FIRST_CHECK = 48  # room (tokens) at which the first search runs
# A runaway: the output ends with a block of tokens repeated back to back, at least RUNAWAY_REPEATS times and
# over at least RUNAWAY_SPAN tokens (so [0, 0, 0] is an answer, twelve zeros in a row are not), blocks up to
# RUNAWAY_PERIOD tokens long (whole array items); or a number longer than RUNAWAY_DIGITS digits (past int64
# and a double's precision).
RUNAWAY_REPEATS = 3
RUNAWAY_SPAN = 24
RUNAWAY_PERIOD = 96
RUNAWAY_DIGITS = 20
# A repeated block at least this long is a whole item: the repeats are taken back, the first kept.
ITEM_PERIOD = 8
MARGIN = 4  # tokens one more step may take beyond the completion found
RETRY_EVERY = 4  # after a search that found nothing, steps until the next
RUNAWAY_DEADLINE_S = 0.2  # a runaway's search: once per answer, and worth more than the budget's per-step one
# A budget search's deadline, in the answer's own steps: a search that finds nothing spends all of it, every few
# tokens near the end. At a flat 50 ms, answers the budget cuts on corral-tiny (a 2 ms step) took 4x as long to
# finish (bisected to the commit that added closing); a step of 10 ms or more (Gemma 3) keeps the full 50 ms.
SEARCH_STEPS = 5
MIN_SEARCH_DEADLINE_S = 0.01


def search_deadline(forward_ms: list[float]) -> float:
    """The per-step budget search's deadline for an answer whose recent forwards took `forward_ms`: SEARCH_STEPS
    of its median step, between MIN_SEARCH_DEADLINE_S and samplers/closing.py's DEFAULT_DEADLINE_S."""
    if not forward_ms:
        return DEFAULT_DEADLINE_S
    recent = sorted(forward_ms[-8:])
    step_s = recent[len(recent) // 2] / 1000
    return min(DEFAULT_DEADLINE_S, max(MIN_SEARCH_DEADLINE_S, SEARCH_STEPS * step_s))


class ClosedBecause(StrEnum):
    BUDGET = "budget"  # max_tokens or the context was about to end the answer
    RUNAWAY = "runaway"  # the model repeated itself or grew a value without end


class AnswerCloser:
    """One sequence's closing state: when to search next, and the last completion found (and at what output
    length), which the engine falls back to when a later step leaves nothing that fits."""

    def __init__(
        self, vocab: ClosingVocabulary, keys: frozenset[str] = frozenset(), examples: tuple[str, ...] = ()
    ) -> None:
        self.vocab = vocab
        self.keys = keys  # required property names: a completion writes these rather than optional ones
        self.examples = examples  # texts the schema's patterns match: what a string that may not end needs
        self.next_check = FIRST_CHECK
        self.closed: ClosedBecause | None = None
        self.fallback: tuple[int, list[int]] | None = None  # (output length it starts at, the completion)
        self.runaway_retry_at = 0  # output length before which a failed runaway search is not repeated
        self.long_search_spent = False  # the budget's one longer search (plan_if_due) has run
        self.chosen: list[bool] = []  # per output token: the model chose it (False: the grammar dictated it)

    def record(self, output_len: int, chosen: list[bool]) -> None:
        """The flags of the tokens just appended (a revision may have taken back the tail since)."""
        del self.chosen[output_len - len(chosen) :]
        self.chosen.extend(chosen)

    def runaway_period(self, tokens: list[int], text: Callable[[int], str]) -> int:
        """`repeated_block`, counting only blocks the model chose something in (a block the grammar dictated
        throughout, thirty items of a one-value enum that must have thirty, is the schema's doing) and that do
        not close anything (thirty `}` in a row end thirty nested objects: progress, not a loop)."""
        period = repeated_block(tokens)
        if not period or not any(self.chosen[-period:]):
            return 0
        closing_only = all(not c.strip() or c in "}]" for t in tokens[-period:] for c in text(t))
        return 0 if closing_only else period

    def seed(self, matcher: Matcher, room: int) -> None:
        """Before the first token, where the budget barely holds the grammar's shortest answer: that answer, as
        the fallback. The model's first step may leave no completion that fits (a first token ` {` makes the
        answer one token longer than the grammar's `{"`); the answer then closes from the start instead. Only
        then: with room to spare, a dead end later is the revision's to undo, not the closing's."""
        if not self.due(room):
            return
        # Once per answer, so the runaway's longer deadline: the per-step one missed it on a loaded machine.
        plan = shortest_completion(
            matcher, self.vocab, room, keys=self.keys, deadline_s=RUNAWAY_DEADLINE_S, examples=self.examples
        )
        if plan is not None and len(plan) + MARGIN >= room:
            self.fallback = (0, plan)

    def due(self, room: int) -> bool:
        return room <= self.next_check

    def plan_if_due(
        self, matcher: Matcher, room: int, at: int, text: Callable[[], str], deadline_s: float = DEFAULT_DEADLINE_S
    ) -> tuple[int, list[int]] | None:
        """When the answer must close now: (output length to cut back to, completion from there) — `at` (the
        output length now) with a completion that fits, or the last fallback when none fits any more. None
        while there is room (or nothing to close with). `deadline_s`: the search's (`search_deadline`)."""
        if not self.due(room):
            return None
        plan = shortest_completion(
            matcher, self.vocab, room, prefix=text(), keys=self.keys, deadline_s=deadline_s, examples=self.examples
        )
        if plan is None and self.fallback is None and not self.long_search_spent:
            # Nothing to fall back on yet: once per answer, the runaway's longer search. On a loaded machine the
            # per-step one missed its deadline at every check and the answer was cut (Gemma 3, Github_hard o61653).
            # As long as four per-step searches at most (the full 0.2 s from a 10 ms step up).
            self.long_search_spent = True
            plan = shortest_completion(
                matcher, self.vocab, room, prefix=text(), keys=self.keys,
                deadline_s=min(RUNAWAY_DEADLINE_S, 4 * deadline_s), examples=self.examples,
            )
        if plan is None:
            self.next_check = room - RETRY_EVERY
            return self.fallback
        if len(plan) + MARGIN < room:
            self.fallback = (at, plan)
            self.next_check = 2 * len(plan) + MARGIN
            return None
        return at, plan

    def plan_now(
        self, matcher: Matcher, room: int, at: int, text: Callable[[], str], *, last_chance: bool = False
    ) -> list[int] | None:
        """A completion that fits the room left, whatever the budget (a runaway closes at once). A runaway is
        worth a longer search (it happens once), and one that found nothing is not repeated for a few tokens
        (`at`: the output length now): the answer is runaway on every step meanwhile. `last_chance` (the
        watchdog is about to end the answer as a stall) searches regardless: there is no later step."""
        if at < self.runaway_retry_at and not last_chance:
            return None
        plan = shortest_completion(
            matcher, self.vocab, room, prefix=text(), keys=self.keys, deadline_s=RUNAWAY_DEADLINE_S,
            examples=self.examples,
        )
        if plan is None:
            self.hold_off(at)
        return plan

    def hold_off(self, at: int) -> None:
        """No runaway search for a few tokens (one found nothing, or a completion too long to take)."""
        self.runaway_retry_at = at + RETRY_EVERY * 2


def repeated_block(tokens: list[int]) -> int:
    """The shortest period p such that the output ends with max(RUNAWAY_REPEATS × p, RUNAWAY_SPAN) tokens that
    repeat every p tokens (0: none)."""
    last = tokens[-1] if tokens else None
    for period in range(1, RUNAWAY_PERIOD + 1):
        span = max(RUNAWAY_REPEATS * period, RUNAWAY_SPAN)
        if span > len(tokens):
            break
        if tokens[-1 - period] != last:
            continue  # cheap filter first: a cycle of this period repeats the last token
        if tokens[-span:-period] == tokens[-span + period :]:
            return period
    return 0


def trailing_digits(tokens: list[int], text: Callable[[int], str]) -> int:
    """Digits at the end of the output (a number being written), counted back token by token."""
    digits = 0
    for token in reversed(tokens):
        piece = text(token)
        tail = len(piece) - len(piece.rstrip("0123456789"))
        digits += tail
        if tail < len(piece) or digits > RUNAWAY_DIGITS:
            break
    return digits
