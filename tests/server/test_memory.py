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
