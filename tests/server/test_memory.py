"""`corral serve` caps glibc's malloc arenas unless the user chose a value."""

from __future__ import annotations

import subprocess
import sys

import pytest

CALL = "from corral.server.memory import limit_malloc_arenas; print(limit_malloc_arenas())"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux-only")
def test_arenas_are_capped_unless_the_environment_sets_them() -> None:
    fresh = subprocess.run([sys.executable, "-c", CALL], capture_output=True, text=True, check=True,
                           env={"PATH": "/usr/bin:/bin"})
    assert fresh.stdout.strip() == "True"
    chosen = subprocess.run([sys.executable, "-c", CALL], capture_output=True, text=True, check=True,
                            env={"PATH": "/usr/bin:/bin", "MALLOC_ARENA_MAX": "8"})
    assert chosen.stdout.strip() == "False"



def test_a_model_that_cannot_fit_is_refused_and_a_cache_that_could_outgrow_memory_is_warned_of() -> None:
    from corral.server.memory import RUNTIME_BYTES, memory_verdict

    gb = 1 << 30
    error, warning = memory_verdict(3 * gb, 1 * gb, 2 * gb)
    assert error is not None and "needs about 4.0 GB" in error and "2.0 GB are available" in error
    assert warning is None
    error, warning = memory_verdict(1 * gb, 4 * gb, 1 * gb + RUNTIME_BYTES + 2 * gb)
    assert error is None and warning is not None and "can grow to 4.0 GB" in warning and "--max-batch" in warning
    assert memory_verdict(1 * gb, 1 * gb, 8 * gb) == (None, None)
    assert memory_verdict(100 * gb, 1 * gb, None) == (None, None)  # not Linux: nothing to say


def test_serve_refuses_a_model_larger_than_the_memory_in_one_sentence(monkeypatch: pytest.MonkeyPatch) -> None:
    """`corral serve` exits 2 before serving, naming what the model needs and what the machine has."""
    from corral.server import cli, memory

    monkeypatch.setattr(memory, "available_bytes", lambda: 512 << 20)
    from corral.server.models import load_model
    from corral.server.settings import Settings

    loaded = load_model("corral-tiny", device="cpu")
    problem = cli._memory_problem(loaded, Settings())
    assert problem is not None and problem.startswith("the model needs about") and "0.5 GB are available" in problem


TRIM_SCRIPT = """
from corral.server.memory import release_freed_memory
def rss():
    return int(open('/proc/self/statm').read().split()[1]) * 4096
blocks = [bytearray(1000 + i % 64) for i in range(400_000)]  # ~0.45 GB in small chunks
pin = bytearray(1000)  # above them on the heap: glibc cannot give the freed chunks back by shrinking it
full = rss()
del blocks
held = rss()
trimmed = release_freed_memory()
print(round((full - held) / 1e6), round((held - rss()) / 1e6), trimmed)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim is Linux-only")
def test_freed_memory_goes_back_to_the_kernel() -> None:
    """What was freed in small chunks leaves the process once `release_freed_memory` runs (the server calls it
    at start and when its engine falls idle): RSS drops by most of the 0.45 GB freed."""
    out = subprocess.run([sys.executable, "-c", TRIM_SCRIPT], capture_output=True, text=True, check=True)
    freed_mb, trimmed_mb, trimmed = out.stdout.split()
    assert int(freed_mb) < 100, "glibc gave the chunks back by itself: the test no longer shows the trim"
    assert int(trimmed_mb) > 300 and trimmed == "True"


def test_the_engine_loop_trims_when_it_falls_idle_after_work(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from corral.server.engine import loop

    trims = threading.Event()
    monkeypatch.setattr(loop, "release_freed_memory", lambda collect=True: trims.set() or True)
    monkeypatch.setattr(loop, "TRIM_INTERVAL_S", 0.0)

    class OneStep:
        steps = 1

        def has_work(self) -> bool:
            return self.steps > 0

        def step(self) -> None:
            assert not trims.is_set(), "trimmed while there was work"
            self.steps -= 1

        def fail_all(self, message: str) -> None: ...
        def shutdown(self) -> None: ...

    running = loop.EngineLoop(OneStep())  # type: ignore[arg-type]
    running.start()
    try:
        assert trims.wait(5), "the loop fell idle after a step and never handed memory back"
    finally:
        running.stop()
