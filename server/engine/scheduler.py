"""Owns the waiting queue and the running batch; requests join and leave between steps."""

from __future__ import annotations

from collections import deque

from server.engine.sequence import SeqStatus, Sequence


class Scheduler:
    def __init__(self, max_batch: int, prefill_token_budget: int = 8192) -> None:
        self.max_batch = max_batch
        self.prefill_token_budget = prefill_token_budget
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._free_slots = list(range(max_batch - 1, -1, -1))  # pop() hands out the lowest slot

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Sequence]:
        """Admit waiting sequences into free slots (bounded prefill per step), return the batch."""
        budget = self.prefill_token_budget
        while self.waiting and self._free_slots:
            seq = self.waiting[0]
            if budget < len(seq.pending) and budget != self.prefill_token_budget:
                break  # a long prompt waits for the next step rather than stalling everyone now
            self.waiting.popleft()
            budget -= len(seq.pending)
            seq.slot = self._free_slots.pop()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
        return list(self.running)

    def finish(self, seq: Sequence) -> None:
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self._free_slots.append(seq.slot)
            self._free_slots.sort(reverse=True)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    def find(self, request_id: str) -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                return seq
        return None
