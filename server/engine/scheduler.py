"""Owns the waiting queue and the running batch; requests join and leave between steps."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq
from typing import Protocol

from server.engine.sequence import SeqStatus, Sequence


class SlotPlacer(Protocol):
    """Chooses a free KV slot for a prompt and says how many of its tokens that slot already holds."""

    def place(self, prompt: Seq[int], free_slots: Seq[int]) -> tuple[int, int]: ...

    def release(self, slot: int) -> None: ...


class Scheduler:
    def __init__(self, max_batch: int, prefill_token_budget: int = 8192, placer: SlotPlacer | None = None) -> None:
        self.max_batch = max_batch
        self.prefill_token_budget = prefill_token_budget
        self.placer = placer
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
            self._place(seq)
            budget -= len(seq.pending)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
        return list(self.running)

    def _place(self, seq: Sequence) -> None:
        if self.placer is None or seq.num_cached or seq.output_ids:
            seq.slot = self._free_slots.pop()
            return
        seq.slot, hit = self.placer.place(seq.prompt_ids, self._free_slots)
        self._free_slots.remove(seq.slot)
        # Only the uncached suffix of the prompt is computed.
        seq.num_cached = hit
        seq.pending = seq.pending[hit:]

    def finish(self, seq: Sequence) -> None:
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self._free_slots.append(seq.slot)
            self._free_slots.sort(reverse=True)
            if self.placer is not None:
                self.placer.release(seq.slot)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    def find(self, request_id: str) -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                return seq
        return None
