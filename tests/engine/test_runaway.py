"""What counts as a runaway (corral/structured/answer_closing.py): a block repeated back to back over the window,
and a number past any plausible width; what does not: short repeats, and an answer that merely varies."""

from __future__ import annotations

from typing import cast

import pytest

from corral.grammar_engines.protocol import Matcher
from corral.structured import answer_closing
from corral.structured.answer_closing import RUNAWAY_DIGITS, RUNAWAY_SPAN, repeated_block, trailing_digits
from corral.structured.closing import ClosingVocabulary

ITEM = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]  # ten tokens, e.g. `{"name": "Widget", "qty": 2}, `


def test_an_item_repeated_three_times_is_a_runaway_of_its_length() -> None:
    assert repeated_block([1, 2, *ITEM, *ITEM, *ITEM]) == len(ITEM)
    assert repeated_block([1, 2, *ITEM, *ITEM]) == 0  # twice may be what the text holds
    assert repeated_block([*ITEM, *ITEM, *ITEM, 99]) == 0  # the output moved on


def test_short_cycles_must_span_the_window() -> None:
    pair = [7, 8]
    assert repeated_block(pair * (RUNAWAY_SPAN // 2)) == 2  # the shortest period, not a multiple of it
    assert repeated_block([5] + pair * (RUNAWAY_SPAN // 2 - 1)) == 0
    assert repeated_block([3] * RUNAWAY_SPAN) == 1


def test_items_that_vary_are_not_a_runaway() -> None:
    varied = [tok for i in range(6) for tok in (*ITEM[:-1], 100 + i)]
    assert repeated_block(varied) == 0


def test_digits_are_counted_across_tokens() -> None:
    texts = {1: '": ', 2: "123", 3: "4", 4: " 56", 5: "x"}
    assert trailing_digits([1, 2, 3], texts.__getitem__) == 4
    assert trailing_digits([1, 4, 2], texts.__getitem__) == 5  # ` 56` ends in two digits, then stops
    assert trailing_digits([5], texts.__getitem__) == 0
    assert trailing_digits([1] + [2] * 10, texts.__getitem__) > RUNAWAY_DIGITS


def test_the_last_chance_search_ignores_the_hold_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """After a runaway search found nothing, the next few steps skip it; when the stall watchdog is about to end
    the answer there is no later step, so that search runs anyway."""
    searches: list[int] = []
    monkeypatch.setattr(answer_closing, "shortest_completion", lambda *a, **k: searches.append(1))
    closer = answer_closing.AnswerCloser(cast(ClosingVocabulary, None))
    matcher = cast(Matcher, None)
    closer.hold_off(10)
    assert closer.plan_now(matcher, 50, 12, str) is None and not searches  # held off: no search
    closer.plan_now(matcher, 50, 12, str, last_chance=True)
    assert searches == [1]
    closer.plan_now(matcher, 50, 12 + 2 * answer_closing.RETRY_EVERY, str)  # the last one found none: held off
    assert searches == [1, 1]


def test_a_budget_search_is_bounded_in_mask_fills_not_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a budget search finds must not depend on how loaded the machine is or how many rows share the step:
    it gets a fixed number of mask fills, the time bound only as a backstop far above it."""
    calls: list[dict[str, object]] = []

    def search(*args: object, **kwargs: object) -> list[int] | None:
        calls.append(kwargs)
        return None

    monkeypatch.setattr(answer_closing, "shortest_completion", search)
    closer = answer_closing.AnswerCloser(cast(ClosingVocabulary, None))
    closer.plan_if_due(cast(Matcher, None), answer_closing.FIRST_CHECK, 16, str)
    assert [c["nodes"] for c in calls] == [answer_closing.BUDGET_NODES]  # one search: no second, longer one
    assert calls[0]["deadline_s"] == answer_closing.RUNAWAY_DEADLINE_S
    closer.plan_if_due(cast(Matcher, None), 10, 54, str)  # a completion found takes about a fill a token
    assert calls[-1]["nodes"] == 10


def test_budget_searches_that_find_nothing_come_less_often(monkeypatch: pytest.MonkeyPatch) -> None:
    """Misses in a row (an answer no short completion reaches) are looked at again after MISS_RETRY tokens, then
    twice that; a completion found resets it. On corral-tiny a miss every 4 tokens was half of all closing time."""
    found: list[int] | None = None
    rooms: list[int] = []

    def search(matcher: object, vocab: object, room: int, **kwargs: object) -> list[int] | None:
        rooms.append(room)
        return found

    monkeypatch.setattr(answer_closing, "shortest_completion", search)
    closer = answer_closing.AnswerCloser(cast(ClosingVocabulary, None))
    matcher = cast(Matcher, None)
    for room in range(answer_closing.FIRST_CHECK, 0, -1):
        closer.plan_if_due(matcher, room, 64 - room, str)
    retry = answer_closing.MISS_RETRY
    first = answer_closing.FIRST_CHECK
    assert rooms == [first, first - retry, first - 3 * retry, first - 5 * retry]
    rooms.clear()
    closer = answer_closing.AnswerCloser(cast(ClosingVocabulary, None))
    closer.plan_if_due(matcher, first, 16, str)  # a miss
    found = [1, 2]
    closer.plan_if_due(matcher, first - retry, 24, str)  # found: the misses are forgotten
    assert closer.misses == 0 and closer.fallback == (24, [1, 2])


def test_after_a_completion_is_found_the_next_search_waits_for_half_the_slack(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A completion of n tokens found with room r: the next search comes once half of the slack
    (r - n - MARGIN) is used, never later than the step before it would no longer fit."""
    completion = list(range(20))
    rooms: list[int] = []

    def search(matcher: object, vocab: object, room: int, **kwargs: object) -> list[int] | None:
        rooms.append(room)
        return completion  # the answer's completion stays 20 tokens long

    monkeypatch.setattr(answer_closing, "shortest_completion", search)
    closer = answer_closing.AnswerCloser(cast(ClosingVocabulary, None))
    closed_at = None
    for room in range(answer_closing.FIRST_CHECK, 0, -1):
        if closer.plan_if_due(cast(Matcher, None), room, 64 - room, str) is not None:
            closed_at = room
            break
    margin = answer_closing.MARGIN
    assert rooms == [48, 36, 30, 27, 26, 25, 24]  # slack 24: next after 12 tokens, then 6, 3, then every step
    assert closed_at == len(completion) + margin  # closed where the completion just fits
    # (The earlier rule, every step from 2n + MARGIN = 44 down, made it 21 searches.)


def test_a_short_completion_found_early_is_checked_again_before_a_longer_one_stops_fitting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`]` found right after `[` (1 token), then the model opens an object and a string whose completion takes 8
    tokens: the answer must close from there, keeping what it wrote, not fall back to `[]` (seen on Gemma 3
    under `gguf` when the next search waited for a room of 2n + MARGIN = 6)."""
    rooms: list[int] = []

    def search(matcher: object, vocab: object, room: int, **kwargs: object) -> list[int] | None:
        rooms.append(room)
        return [9] if room == 31 else list(range(8))

    monkeypatch.setattr(answer_closing, "shortest_completion", search)
    closer = answer_closing.AnswerCloser(cast(ClosingVocabulary, None))
    closed = None
    for room in range(31, 0, -1):
        closed = closer.plan_if_due(cast(Matcher, None), room, 32 - room, str)
        if closed is not None:
            break
    assert closed is not None
    at, plan = closed
    assert plan == list(range(8)) and at > 1  # closed where it stood, not from the first fallback at `[`
    assert at + len(plan) <= 32  # within the budget
    assert len(rooms) <= 8  # a halving schedule, not a search every step
