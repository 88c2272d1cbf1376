"""The soak's process sample counts every descendant: compile workers are forked by the zygote, not the server."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.soak.procinfo import sample

# A child that starts a grandchild and waits: the shape of server -> zygote -> worker.
_TREE = (
    "import subprocess, sys, time; "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads Linux /proc")
def test_grandchildren_are_counted() -> None:
    child = subprocess.Popen([sys.executable, "-c", _TREE])
    try:
        deadline = time.monotonic() + 30
        found = sample(os.getpid())
        while (found is None or found.children < 2) and time.monotonic() < deadline:
            time.sleep(0.1)
            found = sample(os.getpid())
        assert found is not None and found.children >= 2 and found.children_rss_mb > 0
        assert found.rss_mb > 0 and found.fds > 0
    finally:
        grandchildren = Path(f"/proc/{child.pid}/task/{child.pid}/children").read_text().split()
        for pid in grandchildren:
            os.kill(int(pid), 9)
        child.kill()
        child.wait()
