"""What other threads hand the engine thread: requests to add and request ids to abort, in arrival order."""

from __future__ import annotations

import queue
from collections.abc import Iterator

from corral.server.engine.sequence import Sequence


class Inbox:
    """Thread-safe; only the engine thread (or whoever stands in for it once it has ended) takes from it."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[str, Sequence | str]] = queue.SimpleQueue()

    def add(self, seq: Sequence) -> None:
        self._queue.put(("add", seq))

    def abort(self, request_id: str) -> None:
        self._queue.put(("abort", request_id))

    def empty(self) -> bool:
        return self._queue.empty()

    def drain(self) -> Iterator[Sequence | str]:
        """Everything queued so far, in order: a Sequence to admit, or the id of a request to abort."""
        while True:
            try:
                _, item = self._queue.get_nowait()
            except queue.Empty:
                return
            yield item

    def take_added(self) -> list[Sequence]:
        """Sequences submitted but never admitted (their aborts are moot once they are answered)."""
        return [item for item in self.drain() if isinstance(item, Sequence)]
