"""Which of corral's threads run torch on more than one CPU thread: the engine's only.

Why: torch's CPU kernels run on OpenMP (GNU libgomp in the PyPI wheels). libgomp keeps a worker team for every
thread that has run a parallel region, for as long as that thread lives, and once the workers it manages
outnumber the CPUs it spins only ~100 polls before sleeping instead of ~300,000; then each of a decode step's
~250 small parallel regions pays a futex wake-up. On Gemma 3 270M the decoder ran slower on a second thread when
the main thread had loaded the model on two threads than when it never had (measured:
docs/serving-benchmark-history.md#2026-11-26-fourth-only-the-engine-thread-runs-torch-wide). So the model loads
on a thread that exits afterwards (its team goes with it), and every thread corral starts besides the engine's
runs torch on one thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")


def on_passing_thread(work: Callable[[], T], threads: int, name: str = "corral-load") -> T:
    """Run `work` on a new thread with `threads` torch threads and return its result (or raise what it
    raised). The thread, and any OpenMP team it formed, is gone when this returns."""
    box: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        torch.set_num_threads(threads)
        try:
            box.append(work())
        except BaseException as exc:  # handed to the caller, which raises it on its own thread
            errors.append(exc)

    # A daemon, so that Ctrl-C while it works (a first start converts the model for minutes) ends the process
    # at once instead of waiting for the work; what it writes to the model cache is renamed into place only
    # when complete (corral/server/models/build_cache.py).
    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return box[0]


def single_torch_thread() -> None:
    """Torch runs on one thread on the calling thread; the initializer of corral's helper thread pools.

    Set explicitly because a thread's first parallel torch call takes the count last set on *any* thread
    (the engine's, which may be all cores)."""
    torch.set_num_threads(1)


def helper_pool(workers: int, name: str) -> ThreadPoolExecutor:
    """A thread pool whose threads run torch on one thread each (masks, request preparation, compiles)."""
    return ThreadPoolExecutor(workers, thread_name_prefix=name, initializer=single_torch_thread)
