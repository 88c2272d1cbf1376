"""`corral serve` caps glibc's malloc arenas unless the user chose a value."""

from __future__ import annotations

import subprocess
import sys

import pytest

CALL = "from server.memory import limit_malloc_arenas; print(limit_malloc_arenas())"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux-only")
def test_arenas_are_capped_unless_the_environment_sets_them() -> None:
    fresh = subprocess.run([sys.executable, "-c", CALL], capture_output=True, text=True, check=True,
                           env={"PATH": "/usr/bin:/bin"})
    assert fresh.stdout.strip() == "True"
    chosen = subprocess.run([sys.executable, "-c", CALL], capture_output=True, text=True, check=True,
                            env={"PATH": "/usr/bin:/bin", "MALLOC_ARENA_MAX": "8"})
    assert chosen.stdout.strip() == "False"

