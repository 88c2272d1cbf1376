"""Owns the waiting queue and the running batch; requests join and leave between steps."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq
from typing import Protocol

from corral.server.engine.sequence import SeqStatus, Sequence


class SlotPlacer(Protocol):
    """Chooses a free KV slot for a prompt and says how many of its tokens that slot already holds."""

    def place(self, prompt: Seq[int], free_slots: Seq[int]) -> tuple[int, int]: ...

    def release(self, slot: int) -> None: ...

    def worth_waiting(self, prompt: Seq[int], computing: Seq[Seq[int]]) -> bool: ...


class Scheduler:
    def __init__(self, max_batch: int, prefill_token_budget: int = 8192, placer: SlotPlacer | None = None) -> None:
        self.max_batch = max_batch
        self.prefill_token_budget = prefill_token_budget
        self.placer = placer
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._free_slots = list(range(max_batch - 1, -1, -1))  # pop() hands out the lowest slot
        self.step_tokens = 0  # tokens the scheduled step computes (prompts, decode rows): the hung-step watchdog's

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Sequence]:
        """Admit waiting sequences into free slots (bounded prefill per step), return the batch. A fresh
        prompt that shares its prefix with one admitted in this same step waits one step (see
        `SlotPlacer.worth_waiting`); the ones behind it are not held up."""
        budget = self.prefill_token_budget
        computing: list[list[int]] = []  # prompts admitted this step whose KV is not written yet
        deferred: list[Sequence] = []
        while self.waiting and self._free_slots:
            seq = self.waiting[0]
            if budget < len(seq.pending) and budget != self.prefill_token_budget:
                break  # a long prompt waits for the next step rather than stalling everyone now
            self.waiting.popleft()
            if self._fresh(seq) and self.placer is not None and self.placer.worth_waiting(seq.prompt_ids, computing):
                deferred.append(seq)
                continue
            self._place(seq)
            budget -= len(seq.pending)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            if len(seq.pending) > 1:
                computing.append(seq.prompt_ids)
        self.waiting.extendleft(reversed(deferred))  # at the front again, in their order
        self.step_tokens = sum(len(seq.pending) for seq in self.running)
        return list(self.running)

    def _fresh(self, seq: Sequence) -> bool:
        """Not started yet: its whole prompt is still to be placed (not a resumed or revised sequence)."""
        return not seq.num_cached and not seq.output_ids

    def _place(self, seq: Sequence) -> None:
        if self.placer is None or not self._fresh(seq):
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
