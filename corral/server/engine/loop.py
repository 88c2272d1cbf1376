"""Runs the engine's steps on a thread of their own."""

from __future__ import annotations

import logging
import threading
import time

from corral.server.engine.engine import Engine
from corral.server.engine.sequence import Sequence
from corral.server.memory import release_freed_memory

log = logging.getLogger(__name__)

# When the engine falls idle after work, glibc is asked to hand back what the steps freed (KV rows of finished
# answers, graph inputs, compiled grammars' parses), at most this often: the server's memory then stays flat
# over a long run instead of keeping its peak.
TRIM_INTERVAL_S = 10.0


class EngineLoop:
    """Runs `Engine.step()` on a dedicated thread until stopped; sleeps when there is no work."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="corral-engine", daemon=True)
        self.step_started: float | None = None  # monotonic time the current step began, or None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop the loop; every request still in flight gets a final answer (an error), never silence."""
        self._stopped.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        message = "the server stopped before this request finished"
        if self._thread.is_alive():  # stuck in a step: answer without touching its state
            self.engine.abandon_all(message, "error")
        else:
            self.engine.fail_all(message)
        self.engine.shutdown()

    def submit(self, seq: Sequence) -> None:
        self.engine.add_request(seq)
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._wake.set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        worked, trimmed = False, time.monotonic()
        while not self._stopped.is_set():
            if not self.engine.has_work():
                if worked and time.monotonic() - trimmed >= TRIM_INTERVAL_S:
                    release_freed_memory(collect=False)
                    worked, trimmed = False, time.monotonic()
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            worked = True
            self.step_started = time.monotonic()
            try:
                self.engine.step()
            except Exception as exc:  # the loop must survive anything one batch does
                log.exception("engine step failed")
                self.engine.fail_all(f"internal engine error: {type(exc).__name__}: {exc}")
            finally:
                self.step_started = None
