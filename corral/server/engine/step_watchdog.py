"""The hung-step watchdog: a thread beside the engine loop that notices a step running past its deadline.

Such a step cannot be interrupted (it is inside the model or a grammar engine), so the watchdog answers every
in-flight request with an error, reports the server unhealthy, and (if asked) exits the process so a
supervisor (docker `restart:`, systemd, Kubernetes) starts a fresh one."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from corral.server.engine.engine import Engine
from corral.server.engine.loop import EngineLoop
from corral.structured import Trip

log = logging.getLogger(__name__)

EXIT_STATUS = 70  # EX_SOFTWARE: an internal error a restart may clear
# A step that computes a long prompt is slow, not hung: its deadline grows by the base deadline for every this many
# tokens it computes (a prompt is computed in one step, and a long one had the watchdog end the server). 512 tokens
# a deadline allows ~8.5 tokens/s at the default 60 s, well below Qwen2.5 1.5B's prefill on 2 busy cores
# (measured: docs/measured-choices.md#hung-step-deadline).
TOKENS_PER_DEADLINE = 512


def step_deadline(base_s: float, step_tokens: int) -> float:
    """How long a step that computes `step_tokens` tokens may run before it counts as hung."""
    return base_s * max(1.0, step_tokens / TOKENS_PER_DEADLINE)


class StepWatchdog:
    def __init__(
        self,
        engine: Engine,
        loop: EngineLoop,
        deadline_s: float,
        *,
        exit_on_hang: bool,
        on_trip: Callable[[], None] = lambda: None,
    ) -> None:
        self.engine = engine
        self.loop = loop
        self.deadline_s = deadline_s
        self.exit_on_hang = exit_on_hang
        self.on_trip = on_trip
        self.healthy = True
        self.exit_process: Callable[[int], None] = os._exit  # replaced in tests
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="corral-step-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()

    def _watch(self) -> None:
        while not self._stopping.wait(min(0.25, self.deadline_s / 4)):
            started = self.loop.step_started
            deadline = step_deadline(self.deadline_s, self.engine.scheduler.step_tokens)
            if started is None or time.monotonic() - started <= deadline:
                continue
            log.error("engine step has run for more than %.1f s (%d tokens): failing in-flight requests", deadline,
                      self.engine.scheduler.step_tokens)
            self.healthy = False
            self.on_trip()
            # This thread must not touch the scheduler the stuck step may still use: answer, don't finish.
            self.engine.abandon_all(f"an engine step ran longer than {deadline:g} s", reason=str(Trip.HUNG_STEP))
            if self.exit_on_hang:
                time.sleep(1.0)  # let the error responses reach their clients
                log.error("exiting with status %d so a supervisor restarts the server", EXIT_STATUS)
                self.exit_process(EXIT_STATUS)
            return
