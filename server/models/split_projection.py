"""The vocabulary projection in output slices that the engine thread and one helper thread share.

On CPU the engine runs torch on `cores - 1` threads, so that the grammar-mask thread and HTTP keep a core
(docs/serving-benchmark.md: two torch threads on two loaded cores made steps 8-10× slower, through OpenMP
workers spinning against the mask thread). That leaves the head's matmul, most of a free-text step, on one
core. Here its weight is packed in slices; the engine thread takes slices one by one and a helper thread
takes them too when it gets a core, so the work is shared when the other core is idle and the engine
thread simply does it all when it is not: nothing ever waits for a busy helper, and nothing spins. Each
output element is computed by the same kernel over the same inputs as without the split (tested equal).
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable

import torch

from server.models.projection import Projection

SPLIT_MIN_ELEMENTS = 1 << 22  # the default model's head (128,257 × 64) has 8.2 M
_PARTS = 2


class _Helper:
    """One daemon thread that runs whatever work it is offered, in order."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="corral-head-helper", daemon=True).start()

    def offer(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def _run(self) -> None:
        while True:
            self._jobs.get()()


_helper: _Helper | None = None
_helper_lock = threading.Lock()


def _shared_helper() -> _Helper:
    global _helper
    with _helper_lock:
        if _helper is None:
            _helper = _Helper()
        return _helper


class _Slices:
    """One call's slices: whoever claims a slice computes it into `out`; `done` when all are in."""

    def __init__(self, parts: list[Projection], bounds: list[tuple[int, int]], x: torch.Tensor, out: torch.Tensor):
        self.parts, self.bounds, self.x, self.out = parts, bounds, x, out
        self._next = 0
        self._left = len(parts)
        self._lock = threading.Lock()
        self.done = threading.Event()
        self.error: BaseException | None = None
        # Inference mode is per thread: a helper writing into the caller's (inference) output must be in it too.
        self._inference = torch.is_inference_mode_enabled()

    def work(self) -> None:
        with torch.inference_mode(self._inference):
            self._claim_and_compute()

    def _claim_and_compute(self) -> None:
        while True:
            with self._lock:
                index = self._next
                if index >= len(self.parts):
                    return
                self._next += 1
            try:
                lo, hi = self.bounds[index]
                self.out[:, lo:hi] = self.parts[index](self.x)
            except BaseException as exc:  # reported to the calling thread, never lost in the helper
                self.error = exc
            with self._lock:
                self._left -= 1
                if self._left == 0:
                    self.done.set()


class SplitProjection:
    """A `Projection` over [out_features, in_features] held as `_PARTS` slices of the output axis."""

    def __init__(self, weight: torch.Tensor, *, keep_plain: bool = False) -> None:
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        size = -(-self.out_features // _PARTS)
        self.bounds = [(lo, min(lo + size, self.out_features)) for lo in range(0, self.out_features, size)]
        # Slices are views: each part packs its own (the packed copies together are one weight's worth),
        # and a part that keeps its plain weight keeps a view of this one.
        self.parts = [Projection(weight[lo:hi], keep_plain=keep_plain) for lo, hi in self.bounds]
        self._plain = weight if keep_plain else None
        self._cores = os.cpu_count() or 1

    @property
    def packed(self) -> bool:
        return all(part.packed for part in self.parts)

    def shares_work(self, rows: int) -> bool:
        """Whether a call now hands slices to the helper thread: torch on one thread, another core, and
        more than one row (a single row measured slower shared: 1.4 ms against 1.1, the handoff and
        two half-size memory-bound products cost more than they save)."""
        return rows > 1 and torch.get_num_threads() == 1 and self._cores >= 2

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] == 1 and self._plain is not None and not self.parts[0].uses_packed(1):
            return torch.nn.functional.linear(x, self._plain)  # as Projection computes such a row
        out = torch.empty((*x.shape[:-1], self.out_features), dtype=x.dtype, device=x.device)
        slices = _Slices(self.parts, self.bounds, flat, out.view(-1, self.out_features))
        if self.shares_work(flat.shape[0]):
            _shared_helper().offer(slices.work)
        slices.work()
        slices.done.wait()
        if slices.error is not None:
            raise slices.error
        return out

    def select(self, x: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        """As `Projection.select` (needs `keep_plain`)."""
        assert self._plain is not None, "select needs the plain weight: build the projection with keep_plain"
        return (self._plain.index_select(0, columns) * x.index_select(0, rows)).sum(-1)


def head_projection(weight: torch.Tensor) -> Projection | SplitProjection:
    """The output head: split where it is large and on CPU, else one `Projection`. Keeps the plain weight
    (the grammar-restricted head selects rows of it)."""
    if weight.device.type == "cpu" and weight.numel() >= SPLIT_MIN_ELEMENTS:
        return SplitProjection(weight, keep_plain=True)
    return Projection(weight, keep_plain=True)
