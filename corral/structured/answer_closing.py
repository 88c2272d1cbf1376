"""Answers that close: when a structured answer's token budget runs low, or the model runs away, the engine
ends it with the shortest completion the grammar allows (corral/structured/closing.py) instead of cutting it mid-value.

When to look: a search costs a few mask fills (docs/measured-choices.md#closing-answers), so it runs only once the
room left (max_tokens or the context, whichever ends first) is within `FIRST_CHECK` tokens, and after a search that
found a completion of n tokens, again once half the slack beyond n + `MARGIN` is used; after one that found
nothing, again in `MISS_RETRY` tokens, then twice that. It closes when the completion would leave less than
`MARGIN` tokens: one more step appends a token plus any the grammar forces, and may open a nested value that needs
more to close. If a step still leaves no completion that fits (it opened an object with required properties, say),
the engine takes that step back and closes from where the last completion was found, which still fits: that room
was larger by the tokens the step added.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum

from corral.grammar_engines.protocol import Matcher
from corral.structured.closing import ClosingVocabulary, shortest_completion

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
RETRY_EVERY = 4  # after a runaway search that found nothing, steps until the next
# After a budget search that found nothing, steps until the next, doubled once after a further miss (16: from
# the first check on, the searches come at 48, 40, 24 and 8 tokens of room). Misses in a row mean the answer
# is somewhere no short completion reaches (an object with many required properties left, a string whose
# pattern the model is far from): on corral-tiny every ~4 tokens made misses half of all closing time.
MISS_RETRY = 8
MISS_DOUBLINGS = 1
RUNAWAY_DEADLINE_S = 0.2  # a runaway's search: once per answer, and worth more than the budget's per-step one
# A budget search's size in mask fills, not time: the closing it finds then does not depend on how loaded the
# machine is, and one that finds nothing costs the same at any batch size (a deadline of a few of the answer's
# steps grew with the batch). Over JSONSchemaBench cuts on corral-tiny the searches that found a completion used
# 1-26 fills (about one per token the grammar leaves open), and never more than the room (the tokens the
# completion may take; Gemma 3 the same, with up to 256 allowed): so at most the room, at most BUDGET_NODES. The
# runaway's deadline only bounds a pathological case: under the per-step deadline (closing.py's
# DEFAULT_DEADLINE_S) a loaded machine missed at every check and the answer was cut (Gemma 3, Github_hard o61653),
# which took a second, longer search to undo (measured: docs/measured-choices.md#closing-answers).
BUDGET_NODES = 48


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
        self.misses = 0  # budget searches in a row that found nothing
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

    def opening(self, matcher: Matcher, room: int) -> list[int] | None:
        """The grammar's shortest answer from the start (the matcher before its first token), within `room`:
        what `seed` takes. It depends on the compiled grammar, the room, `keys` and `examples` alone, so the
        engine keeps it per grammar (corral/structured/grammar_tokens.py)."""
        # Once per answer, so the runaway's longer deadline: the per-step one missed it on a loaded machine.
        return shortest_completion(
            matcher, self.vocab, room, keys=self.keys, deadline_s=RUNAWAY_DEADLINE_S, examples=self.examples
        )

    def seed(self, opening: list[int] | None, room: int) -> None:
        """Before the first token, where the budget barely holds the grammar's shortest answer (`opening`):
        that answer, as the fallback. The model's first step may leave no completion that fits (a first token
        ` {` makes the answer one token longer than the grammar's `{"`); the answer then closes from the start
        instead. Only then: with room to spare, a dead end later is the revision's to undo, not the closing's."""
        if opening is not None and len(opening) + MARGIN >= room:
            self.fallback = (0, list(opening))

    def due(self, room: int) -> bool:
        return room <= self.next_check

    def plan_if_due(
        self, matcher: Matcher, room: int, at: int, text: Callable[[], str]
    ) -> tuple[int, list[int]] | None:
        """When the answer must close now: (output length to cut back to, completion from there) — `at` (the
        output length now) with a completion that fits, or the last fallback when none fits any more. None
        while there is room (or nothing to close with)."""
        if not self.due(room):
            return None
        plan = shortest_completion(
            matcher, self.vocab, room, prefix=text(), keys=self.keys, nodes=min(BUDGET_NODES, room),
            deadline_s=RUNAWAY_DEADLINE_S, examples=self.examples,
        )
        if plan is None:
            self.next_check = room - (MISS_RETRY << min(self.misses, MISS_DOUBLINGS))
            self.misses += 1
            return self.fallback
        self.misses = 0
        if len(plan) + MARGIN < room:
            self.fallback = (at, plan)
            # Again once half the slack (the room the completion leaves beyond MARGIN) is used: checking every
            # step from 2n + MARGIN down cost ~20 searches per answer with a long completion. Not waiting for
            # 2n + MARGIN either: a short completion found early (`]` after `[`) grows as the model opens
            # values, and by then the fallback would take the whole answer back (Gemma 3, `gguf`, Github_trivial
            # o60129 at 32 tokens: `[]` after 24 steps, where cutting the string it was writing still fitted).
            slack = room - len(plan) - MARGIN
            self.next_check = room - max(1, slack // 2)
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
