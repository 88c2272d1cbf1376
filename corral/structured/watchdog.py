"""DeadlockWatchdog pieces that need no model: stall detection and the per-step mask budget.

Each trip has a distinct kind; the engine ends the request with that kind as its finish_reason.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum


class Trip(StrEnum):
    COMPILE_TIMEOUT = "compile_timeout"  # the grammar did not compile within its deadline (a 400)
    MASK_TIMEOUT = "mask_timeout"  # mask fills overran their per-step budget too often
    DEAD_END = "dead_end"  # the mask allowed nothing while the grammar was incomplete, and no revision helped
    STALL = "stall"  # a whitespace run or a repeating token cycle past its limit
    REVISION_DEPTH_EXCEEDED = "revision_depth_exceeded"  # more revisions than the request allows
    HUNG_STEP = "hung_step"  # one engine step took longer than its deadline


@dataclass(frozen=True)
class WatchdogLimits:
    stall_whitespace_tokens: int = 64  # consecutive whitespace-only tokens; 0 disables
    stall_repeat_tokens: int = 64  # tokens that must repeat a short cycle exactly to count as a loop; 0 disables
    max_cycle: int = 8  # longest cycle (in tokens) the repeat check looks for
    mask_budget_ms: float = 50.0  # one row's mask fill above this is an overrun
    mask_overruns: int = 8  # overruns tolerated per request before it ends


class StallDetector:
    """Watches one sequence's output for loops that would otherwise burn the whole budget.

    Only tokens the model *chose* can make a loop: a token the grammar dictated (a jump-forward token, or a
    sampled token that every alternative the mask allowed agreed with) is the grammar's doing, and a valid
    answer may be long and repetitive (30 items of a one-value enum, 32 nested objects, a long `const`).
    So dictated tokens never count toward a run or a cycle; a dictated non-whitespace token does end a
    whitespace run (the answer moved on)."""

    def __init__(self, limits: WatchdogLimits, is_whitespace: Callable[[int], bool]) -> None:
        self.limits = limits
        self._is_whitespace = is_whitespace
        self.whitespace_run = 0
        self._chosen: deque[int] = deque(maxlen=limits.stall_repeat_tokens + limits.max_cycle)

    def observe(self, tokens: Sequence[int], chosen: Sequence[bool]) -> bool:
        """Feed the tokens just appended, each flagged chosen (by the model) or not (dictated by the
        grammar). True means stalled."""
        fresh = False
        for token, free in zip(tokens, chosen, strict=True):
            whitespace = self._is_whitespace(token)
            if free:
                self.whitespace_run = self.whitespace_run + 1 if whitespace else 0
                self._chosen.append(token)
                fresh = True
            elif not whitespace:
                self.whitespace_run = 0
        if self.limits.stall_whitespace_tokens and self.whitespace_run >= self.limits.stall_whitespace_tokens:
            return True
        return fresh and self._repeating()

    def _repeating(self) -> bool:
        window = self.limits.stall_repeat_tokens
        if not window:
            return False
        history = list(self._chosen)
        for period in range(1, self.limits.max_cycle + 1):
            if len(history) < window + period:
                break
            if history[-window:] == history[-window - period : -period]:
                return True
        return False

    def reset(self) -> None:
        """Forget everything (a revision took tokens back)."""
        self.whitespace_run = 0
        self._chosen.clear()


# A row allowing at most this many tokens is checked for a dictated choice (see `dictated`).
FEW_ALLOWED = 16


def dictated(token: int, allowed: Sequence[int] | None, text: Callable[[int], str]) -> bool:
    """Whether sampling `token` was no choice: `allowed` (the tokens the mask allowed, when few; None when
    many) all spell the same text as far as they go, so whichever the model took, the answer reads the same.
    E.g. `"`, `"em` and `"empty"` where the grammar admits only `"empty"`. Undecodable pieces (part of a
    multi-byte character) compare as unknown, so they count as choices."""
    if not allowed or token not in allowed:
        return False
    mine = text(token)
    if not mine or "\ufffd" in mine:
        return False
    for other in allowed:
        theirs = text(other)
        if not theirs or "\ufffd" in theirs or not (mine.startswith(theirs) or theirs.startswith(mine)):
            return False
    return True


class MaskBudget:
    """Counts mask fills that overran the per-step budget; past the limit the request must end."""

    def __init__(self, limits: WatchdogLimits) -> None:
        self.limits = limits
        self.overruns = 0

    def record(self, fill_us: float) -> bool:
        if fill_us > self.limits.mask_budget_ms * 1000:
            self.overruns += 1
        return self.overruns > self.limits.mask_overruns
