"""How sequences end: each gets exactly one final answer, whether the engine thread ends it (stop, length, trip,
error, abort) or the hung-step watchdog does from another thread while a step is stuck."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from corral.server.engine.inbox import Inbox
from corral.server.engine.output_stage import OutputStage
from corral.server.engine.scheduler import Scheduler
from corral.server.engine.sequence import SeqOutput, Sequence
from corral.structured import Trip

log = logging.getLogger(__name__)


class Endings:
    def __init__(self, scheduler: Scheduler, output: OutputStage, inbox: Inbox) -> None:
        self.scheduler = scheduler
        self.output = output
        self.inbox = inbox
        self.on_trip: Callable[[str], None] = lambda kind: None
        # Held while a sequence's final answer is given: the engine thread and the hung-step watchdog
        # (another thread) may both end the same sequence; the first one answers.
        self._answer_lock = threading.Lock()

    def trip(self, seq: Sequence, kind: Trip, message: str) -> None:
        seq.trip = str(kind)
        seq.error = message
        self.on_trip(str(kind))
        self.finish(seq, str(kind))

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.is_finished:
            return
        self.scheduler.finish(seq)
        with self._answer_lock:
            if seq.answered:
                return  # the hung-step watchdog answered it while this step ran
            seq.answered = True
            seq.finish_reason = reason
            seq.stats.finished = time.perf_counter()
            seq.sink(self.output.final(seq, reason))

    def reap_answered(self) -> None:
        """Drop sequences the hung-step watchdog already answered (it never touches the scheduler itself)."""
        for seq in [s for s in (*self.scheduler.running, *self.scheduler.waiting) if s.answered]:
            self.scheduler.finish(seq)

    def fail_all(self, message: str, reason: str = "error") -> None:
        """End every live sequence with an error (the loop hit an exception, or it stopped). Engine thread only
        (or once that thread has ended)."""
        for seq in [*self.scheduler.running, *self.scheduler.waiting, *self.inbox.take_added()]:
            seq.error = message
            self.finish(seq, reason)

    def abandon_all(self, message: str, reason: str) -> None:
        """From another thread while the engine thread is stuck in a step: give every live sequence its final
        answer now, touching no scheduler or cache state (the stuck step may still use them). If the step
        ever returns, the engine drops these sequences (`reap_answered`) and answers them no second time."""
        for seq in [*_snapshot(lambda: [*self.scheduler.running, *self.scheduler.waiting]), *self.inbox.take_added()]:
            if not self._answer_lock.acquire(timeout=5):
                log.error("the engine holds its answer lock; %s gets no final answer", seq.request_id)
                continue
            try:
                if seq.answered:
                    continue
                seq.answered = True
                seq.error, seq.finish_reason = message, reason
                seq.stats.finished = time.perf_counter()
                seq.sink(SeqOutput(seq.request_id, "", True, reason, seq))
            finally:
                self._answer_lock.release()


def _snapshot(read: Callable[[], list[Sequence]]) -> list[Sequence]:
    """Copy collections another thread may be changing (a deque raises if mutated while copied)."""
    for _ in range(100):
        try:
            return read()
        except RuntimeError:
            time.sleep(0.001)
    return []
