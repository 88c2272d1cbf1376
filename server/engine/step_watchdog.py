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

from samplers.watchdog import Trip
from server.engine.engine import Engine
from server.engine.loop import EngineLoop

log = logging.getLogger(__name__)

EXIT_STATUS = 70  # EX_SOFTWARE: an internal error a restart may clear


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
        deadline = self.deadline_s
        while not self._stopping.wait(min(0.25, deadline / 4)):
            started = self.loop.step_started
            if started is None or time.monotonic() - started <= deadline:
                continue
            log.error("engine step has run for more than %.1f s: failing in-flight requests", deadline)
            self.healthy = False
            self.on_trip()
            # This thread must not touch the scheduler the stuck step may still use: answer, don't finish.
            self.engine.abandon_all(f"an engine step ran longer than {deadline:g} s", reason=str(Trip.HUNG_STEP))
            if self.exit_on_hang:
                time.sleep(1.0)  # let the error responses reach their clients
                log.error("exiting with status %d so a supervisor restarts the server", EXIT_STATUS)
                self.exit_process(EXIT_STATUS)
            return
