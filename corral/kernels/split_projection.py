"""The vocabulary projection in output slices that the engine thread and one helper thread share.

On CPU a forward often runs torch on `cores - 1` threads, so that the grammar-mask thread and HTTP keep a
core (docs/serving-benchmark.md: two torch threads on two loaded cores made steps 8-10× slower, through OpenMP
workers spinning against the mask thread; the engine picks per forward, corral/server/engine/thread_tuner.py). On one
thread the head's matmul, most of a free-text step, would sit on one core. Here its weight is packed in
slices; the engine thread takes slices one by one and a helper thread takes them too when it gets a core, so
the work is shared when the other core is idle and the engine thread simply does it all when it is not:
nothing ever waits for a busy helper, and nothing spins. Each output element is computed by the same kernel
over the same inputs as without the split (tested equal).
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable

import torch

from corral.kernels.projection import Projection
from corral.kernels.quantized_projection import Quantization, QuantizedProjection, quantizable
from corral.kernels.row_kernel import RowKernel, row_kernel_available
from corral.server.torch_threads import single_torch_thread

SPLIT_MIN_ELEMENTS = 1 << 22  # the default model's head (128,257 × 64) has 8.2 M
SHARE_SINGLE_ROW_MIN_ELEMENTS = 1 << 26  # Gemma 3's head (262,144 × 640) has 168 M
_PARTS = 2


class _Helper:
    """One daemon thread that runs whatever work it is offered, in order."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="corral-head-helper", daemon=True).start()

    def offer(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def _run(self) -> None:
        single_torch_thread()  # a slice is one thread's work (corral/server/torch_threads.py)
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

    def __init__(
        self,
        parts: list[Projection | QuantizedProjection],
        bounds: list[tuple[int, int]],
        x: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
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

    def __init__(
        self,
        weight: torch.Tensor,
        *,
        keep_plain: bool = False,
        quantization: Quantization = "none",
    ) -> None:
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        size = -(-self.out_features // _PARTS)
        self.bounds = [(lo, min(lo + size, self.out_features)) for lo in range(0, self.out_features, size)]
        # Slices are views: each part packs (or quantizes) its own (the copies together are one weight's
        # worth), and a part that keeps its plain weight keeps a view of this one.
        self.parts: list[Projection | QuantizedProjection]
        if quantization == "none":
            self.parts = [Projection(weight[lo:hi], keep_plain=keep_plain) for lo, hi in self.bounds]
        else:
            self.parts = [QuantizedProjection(weight[lo:hi], None, quantization) for lo, hi in self.bounds]
            keep_plain = False  # `select` reads the quantized parts: the logits the full projection gives
        self._plain = weight if keep_plain else None
        # fp16: a single row goes through ggml's kernel, the whole head in one call
        # (corral/kernels/row_kernel.py).
        self._row = RowKernel(weight) if quantization == "fp16" and row_kernel_available() else None
        self._row_served_last = False  # whether the last call went to ggml, whose outputs are rounded
        self._cores = os.cpu_count() or 1
        # A head as large as Gemma 3's takes tens of milliseconds for one row on one core: a second core pays
        # for the handoff many times over, about halving the time (measured: docs/measured-choices.md#projections).
        self._share_single_row = weight.numel() >= SHARE_SINGLE_ROW_MIN_ELEMENTS

    @property
    def packed(self) -> bool:
        return all(part.packed for part in self.parts)

    @property
    def rounds_outputs(self) -> bool:
        """As `QuantizedProjection.rounds_outputs` (a float projection's outputs are exact), for the outputs of the
        last call: a single row on ggml comes back rounded, several rows on fbgemm exact, so a step of many free
        rows skips the refinement's pass over every row's 262k logits (docs/measured-choices.md#logit-refinement)."""
        rounded_parts = any(isinstance(part, QuantizedProjection) and part.rounds_outputs for part in self.parts)
        return self._row_served_last or rounded_parts

    def shares_work(self, rows: int) -> bool:
        """Whether a call now hands slices to the helper thread: torch on one thread, another core, and
        more than one row or a very large head (a single row through the default tiny model's head measured
        slower shared: the handoff and two half-size memory-bound products cost more than they save;
        docs/measured-choices.md#projections)."""
        wide_enough = rows > 1 or self._share_single_row
        return wide_enough and torch.get_num_threads() == 1 and self._cores >= 2

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        self._row_served_last = self._row is not None and self._row.takes(flat.shape[0])
        if self._row_served_last:
            assert self._row is not None
            return self._row(flat.float()).to(x.dtype).view(*x.shape[:-1], self.out_features)
        first = self.parts[0]
        if (
            flat.shape[0] == 1
            and self._plain is not None
            and isinstance(first, Projection)
            and not first.uses_packed(1)
        ):
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
        """As `Projection.select` (needs `keep_plain`, or quantized parts)."""
        if self._plain is not None:
            return (self._plain.index_select(0, columns) * x.index_select(0, rows)).sum(-1)
        values = torch.empty(len(columns), dtype=x.dtype, device=x.device)
        for part, (lo, hi) in zip(self.parts, self.bounds, strict=True):
            mine = ((columns >= lo) & (columns < hi)).nonzero().flatten()
            if len(mine):
                values[mine] = part.select(x, rows.index_select(0, mine), columns.index_select(0, mine) - lo)
        return values


def head_projection(
    weight: torch.Tensor, quantization: Quantization = "none"
) -> Projection | SplitProjection | QuantizedProjection:
    """The output head: split where it is large and on CPU, else one projection. Keeps the plain weight
    unless quantized (the grammar-restricted head selects rows of it)."""
    if weight.device.type == "cpu" and weight.numel() >= SPLIT_MIN_ELEMENTS:
        return SplitProjection(weight, keep_plain=True, quantization=quantization)
    if quantizable(weight, quantization):
        return QuantizedProjection(weight, None, quantization)
    return Projection(weight, keep_plain=True)
