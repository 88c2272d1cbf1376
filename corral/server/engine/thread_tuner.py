"""How many CPU threads torch gets for each forward, chosen from the forwards' measured times.

On this project's 2-core machine a second torch thread shortens Gemma 3's one-row decode step when the other core
is free, and more than doubles it when something else keeps that core busy (measured:
docs/measured-choices.md#torch-threads): an OpenMP thread that loses its core stalls every parallel region at the
barrier. Whether the core is free depends on things the engine cannot see (HTTP, other processes) as well as one
it can (the mask thread filling this step's grammar masks), so the choice is measured, per kind of forward,
rather than fixed.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)


@dataclass
class _Arm:
    mean_ms: float = 0.0
    samples: int = 0


@dataclass
class _KeyState:
    arms: dict[int, _Arm]
    visits: int = 0
    last_explored: dict[int, int] = field(default_factory=dict)
    rechecked: set[int] = field(default_factory=set)  # re-tried now: their next time replaces a stale average
    # Visits between re-tries of each losing count: doubled each time a re-try finds it far slower still.
    intervals: dict[int, int] = field(default_factory=dict)


class ThreadTuner:
    """An epsilon-greedy choice among thread counts, per key (a kind of forward: masked or not, how many
    tokens). Each choice is tried `warmup` times first; then the one with the lowest moving average runs,
    and each other one is re-tried every `explore_every` visits so a change in the machine's load is seen: a
    re-try's time replaces that count's stale average (if it wins by noise, the forwards it then runs correct
    the average within a few steps). A re-try that finds its count far slower still (by `far_slower`, as one
    thread is against two on Gemma 3 at one row) doubles that count's interval, up to
    `max_backoff` times `explore_every`, since each such re-try costs a step its difference; one that comes
    close or wins resets it. The winner's own slowdown needs no re-try: its average rises as it runs."""

    def __init__(
        self,
        choices: Sequence[int],
        *,
        warmup: int = 2,
        explore_every: int = 32,
        smoothing: float = 0.3,
        far_slower: float = 1.25,
        max_backoff: int = 8,
    ) -> None:
        if not choices or any(c < 1 for c in choices):
            raise ValueError(f"thread choices must be positive counts, got {list(choices)}")
        self.choices = tuple(dict.fromkeys(choices))  # distinct, in the given order
        self.warmup = warmup
        self.explore_every = explore_every
        self.smoothing = smoothing
        self.far_slower = far_slower
        self.max_backoff = max_backoff
        self._keys: dict[Hashable, _KeyState] = {}

    def choose(self, key: Hashable) -> int:
        if len(self.choices) == 1:  # a fixed count (`--torch-threads`): nothing to measure
            return self.choices[0]
        state = self._keys.get(key)
        if state is None:
            state = self._keys[key] = _KeyState({c: _Arm() for c in self.choices})
        state.visits += 1
        for choice, arm in state.arms.items():
            if arm.samples < self.warmup:
                return choice
        best = self.best(key)
        for choice in self.choices:
            interval = state.intervals.get(choice, self.explore_every)
            if choice != best and state.visits - state.last_explored.get(choice, 0) >= interval:
                state.last_explored[choice] = state.visits
                state.rechecked.add(choice)
                return choice
        return best

    def record(self, key: Hashable, threads: int, ms: float) -> None:
        state = self._keys.get(key)
        if state is None or threads not in state.arms:
            return
        watched = log.isEnabledFor(logging.DEBUG)
        before = self.best(key) if watched else None
        arm = state.arms[threads]
        fresh = arm.samples == 0 or threads in state.rechecked
        if threads in state.rechecked:
            state.rechecked.discard(threads)
            self._back_off(state, threads, ms)
        arm.mean_ms = ms if fresh else arm.mean_ms + self.smoothing * (ms - arm.mean_ms)
        arm.samples += 1
        if not watched:
            return
        after = self.best(key)
        if after != before and all(a.samples >= self.warmup for a in state.arms.values()):
            log.debug("forwards %s now run on %d threads (ms by count: %s)", key, after, self.snapshot()[str(key)])

    def _back_off(self, state: _KeyState, threads: int, ms: float) -> None:
        """After a re-try of `threads` took `ms`: wait longer before the next one if it was far slower than the
        best of the others, else go back to `explore_every`."""
        others = [a.mean_ms for c, a in state.arms.items() if c != threads and a.samples]
        if others and ms >= self.far_slower * min(others):
            doubled = 2 * state.intervals.get(threads, self.explore_every)
            state.intervals[threads] = min(doubled, self.max_backoff * self.explore_every)
        else:
            state.intervals.pop(threads, None)

    def best(self, key: Hashable) -> int:
        """The choice with the lowest average so far for `key` (the first choice before any measurement)."""
        state = self._keys.get(key)
        if state is None:
            return self.choices[0]
        measured = [(arm.mean_ms, c) for c, arm in state.arms.items() if arm.samples]
        return min(measured)[1] if measured else self.choices[0]

    def snapshot(self) -> dict[str, dict[int, float]]:
        """Average ms per choice for every key seen (for logs and benchmarks)."""
        return {str(k): {c: round(a.mean_ms, 2) for c, a in s.arms.items() if a.samples} for k, s in self._keys.items()}


def forward_key(masked: bool, tokens: int) -> tuple[bool, int]:
    """Forwards that compare: with or without a concurrent mask fill, tokens in powers of two."""
    return masked, max(1, tokens).bit_length()


# Forwards of at least this many tokens (prompts) run on every thread, unmeasured: each of their ops is large, so a
# thread that loses its core delays the barrier by a fraction of an op, while a trial on one thread costs the whole
# forward twice over (Qwen2.5 1.5B here: a 256-token prompt 11.1 s on one thread against 5.3-7.5 on two). Trials
# of one thread per size class of prompt made a few requests' prefill run at half speed.
LARGE_FORWARD_TOKENS = 64


def choose_threads(
    tuner: ThreadTuner | None, torch_threads: TorchThreads, masked: bool, tokens: int
) -> tuple[Hashable, int] | None:
    """Set torch's threads for a forward from the tuner, on the calling thread (the engine's;
    corral/server/torch_threads.py); the key and count chosen (None for a large forward, run on every thread). No
    tuner: torch's setting is left alone."""
    if tuner is None:
        return None
    if tokens >= LARGE_FORWARD_TOKENS:
        torch_threads.use(max(tuner.choices))
        return None
    key = forward_key(masked, tokens)
    threads = tuner.choose(key)
    torch_threads.use(threads)
    return key, threads


def record_threads(tuner: ThreadTuner | None, chosen: tuple[Hashable, int] | None, ms: float) -> None:
    """Record how long a forward took on the threads `choose_threads` chose for it. Its wait for the step's
    masks counts: a second torch thread may slow their fill."""
    if tuner is not None and chosen is not None:
        tuner.record(*chosen, ms)


class TorchThreads:
    """Sets torch's intra-op threads on the calling thread (the engine's) only when the count changes."""

    def __init__(self) -> None:
        self._current: int | None = None  # unknown until the first use: the count is per thread

    def use(self, threads: int) -> None:
        if threads != self._current:
            torch.set_num_threads(threads)
            self._current = threads
