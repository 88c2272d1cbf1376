"""Only the engine thread runs torch on more than one thread (corral/server/torch_threads.py says why)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from corral.server.torch_threads import helper_pool, on_passing_thread


@pytest.fixture(autouse=True)
def _restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_work_on_a_passing_thread_runs_with_the_threads_asked_and_the_thread_is_gone() -> None:
    torch.set_num_threads(1)
    thread, threads = on_passing_thread(lambda: (threading.current_thread(), torch.get_num_threads()), threads=2)
    assert thread is not threading.current_thread()
    assert not thread.is_alive()  # its OpenMP team went with it
    assert thread.daemon  # Ctrl-C during a long load ends the process without waiting for the load
    assert threads == 2
    assert torch.get_num_threads() == 1  # the caller's count is its own


def test_an_error_on_the_passing_thread_reaches_the_caller() -> None:
    def load() -> None:
        raise FileNotFoundError("no such checkpoint")

    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        on_passing_thread(load, threads=1)


def test_helper_pool_threads_run_torch_on_one_thread_whatever_was_set_last() -> None:
    # A thread's first parallel call takes the count last set on any thread: the engine's may be all cores.
    torch.set_num_threads(2)
    pool = helper_pool(2, "test-helper")
    try:
        counts = [pool.submit(torch.get_num_threads).result() for _ in range(4)]
    finally:
        pool.shutdown()
    assert counts == [1, 1, 1, 1]
