"""Two kernels that compute the same product, the faster one per row count, picked from the first calls' times.

ggml's Q8_0 product of a few rows is fastest by a different route on different CPUs and row counts (llamafile's
tiles or ggml's own dot products: docs/measured-choices.md#q8_0-products-of-few-rows), and timing every row count
at load would cost seconds. So each row count's first calls take the two kernels in turn, each call's result
served as it is (both are right), and once each kernel has TRIALS timed calls (after one untimed call that builds
its graph) the faster stays, the first one unless the other is MARGIN faster.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

TRIALS = 2
MARGIN = 0.9


@dataclass
class _Trials:
    calls: list[int] = field(default_factory=lambda: [0, 0])
    best: list[float] = field(default_factory=lambda: [float("inf"), float("inf")])
    chosen: int | None = None


class TimedChoice:
    """`run(rows, first, second)`: one of the two callables' results; which one, as the rows' trials decide."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._trials: dict[int, _Trials] = {}
        self._clock = clock

    def chosen(self, rows: int) -> int | None:
        """0 (the first kernel) or 1, once the trials of `rows` rows have decided; None before."""
        trials = self._trials.get(rows)
        return trials.chosen if trials is not None else None

    def run(self, rows: int, first: Callable[[], torch.Tensor], second: Callable[[], torch.Tensor]) -> torch.Tensor:
        trials = self._trials.setdefault(rows, _Trials())
        if trials.chosen is not None:
            return (first, second)[trials.chosen]()
        which = 0 if trials.calls[0] <= trials.calls[1] else 1
        start = self._clock()
        result = (first, second)[which]()
        if trials.calls[which]:  # the first call of each builds its graph: not timed
            trials.best[which] = min(trials.best[which], self._clock() - start)
        trials.calls[which] += 1
        if min(trials.calls) > TRIALS:
            trials.chosen = 1 if trials.best[1] < MARGIN * trials.best[0] else 0
        return result
