"""DeadlockWatchdog pieces that need no model: stall detection and the per-step mask budget.

Each trip has a distinct kind; the engine ends the request with that kind as its finish_reason.
"""

from __future__ import annotations

from collections.abc import Callable
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
    whitespace_run: int = 64  # consecutive whitespace-only tokens; 0 disables
    repeat_window: int = 64  # tokens that must repeat a short cycle exactly to count as a loop; 0 disables
    max_cycle: int = 8  # longest cycle (in tokens) the repeat check looks for
    mask_budget_ms: float = 50.0  # one row's mask fill above this is an overrun
    mask_overruns: int = 8  # overruns tolerated per request before it ends


class StallDetector:
    """Watches one sequence's output tokens for loops that would otherwise burn the whole budget."""

    def __init__(self, limits: WatchdogLimits, is_whitespace: Callable[[int], bool]) -> None:
        self.limits = limits
        self._is_whitespace = is_whitespace
        self.whitespace_run = 0

    def observe(self, tokens: list[int], history: list[int]) -> bool:
        """Feed the tokens just appended (`history` already ends with them). True means stalled."""
        for token in tokens:
            self.whitespace_run = self.whitespace_run + 1 if self._is_whitespace(token) else 0
        if self.limits.whitespace_run and self.whitespace_run >= self.limits.whitespace_run:
            return True
        return self._repeating(history)

    def _repeating(self, history: list[int]) -> bool:
        window = self.limits.repeat_window
        if not window:
            return False
        for period in range(1, self.limits.max_cycle + 1):
            if len(history) < window + period:
                break
            if history[-window:] == history[-window - period : -period]:
                return True
        return False

    def reset(self) -> None:
        self.whitespace_run = 0


class MaskBudget:
    """Counts mask fills that overran the per-step budget; past the limit the request must end."""

    def __init__(self, limits: WatchdogLimits) -> None:
        self.limits = limits
        self.overruns = 0

    def record(self, fill_us: float) -> bool:
        if fill_us > self.limits.mask_budget_ms * 1000:
            self.overruns += 1
        return self.overruns > self.limits.mask_overruns
