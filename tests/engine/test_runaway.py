"""What counts as a runaway (server/engine/answer_closing.py): a block repeated back to back over the window,
and a number past any plausible width; what does not: short repeats, and an answer that merely varies."""

from __future__ import annotations

from typing import cast

import pytest

from samplers.closing import ClosingVocabulary
from samplers.protocol import Matcher
from server.engine import answer_closing
from server.engine.answer_closing import RUNAWAY_DIGITS, RUNAWAY_SPAN, repeated_block, trailing_digits

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


def test_the_budget_search_tries_once_longer_while_it_has_nothing_to_fall_back_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The per-step search has a short deadline (it holds up the whole batch's step); on a loaded machine it can
    miss at every check, and the answer was cut. With no fallback found yet, one search per answer gets the
    runaway's longer deadline."""
    deadlines: list[float] = []

    def search(*args: object, deadline_s: float = 0.05, **kwargs: object) -> list[int] | None:
        deadlines.append(deadline_s)
        return [7, 8] if deadline_s >= answer_closing.RUNAWAY_DEADLINE_S else None  # only the longer one finds it

    monkeypatch.setattr(answer_closing, "shortest_completion", search)
    closer = answer_closing.AnswerCloser(cast(ClosingVocabulary, None))
    matcher = cast(Matcher, None)
    assert closer.plan_if_due(matcher, answer_closing.FIRST_CHECK, 30, str) is None  # found, with room to spare
    assert deadlines[-1] == answer_closing.RUNAWAY_DEADLINE_S and closer.fallback == (30, [7, 8])
    calls = len(deadlines)
    closer.plan_if_due(matcher, 4, 70, str)  # must close now: the short search misses, the fallback is there
    assert len(deadlines) == calls + 1  # no second long search: it runs once per answer


def test_a_budget_search_costs_a_few_of_the_answers_steps_at_most() -> None:
    """A budget search that finds nothing spends its whole deadline, every few tokens near the end: on a model
    whose step is 2 ms a flat 50 ms made cut answers 4x slower (answer_closing.search_deadline)."""
    from samplers.closing import DEFAULT_DEADLINE_S
    from server.engine.answer_closing import MIN_SEARCH_DEADLINE_S, SEARCH_STEPS, search_deadline

    assert search_deadline([]) == DEFAULT_DEADLINE_S  # no step seen yet: the full deadline
    assert search_deadline([2.0] * 8) == MIN_SEARCH_DEADLINE_S  # corral-tiny: 5 steps would be 10 ms
    assert search_deadline([4.0, 4.0, 400.0]) == pytest.approx(SEARCH_STEPS * 0.004)  # the median, not a stall
    assert search_deadline([25.0] * 8) == DEFAULT_DEADLINE_S  # Gemma 3's steps: as before
