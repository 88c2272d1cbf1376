"""The soak's process sample counts every descendant: compile workers are forked by the zygote, not the server."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from corral.benchmarks.soak.procinfo import sample

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


def test_a_listening_server_is_found_by_its_port_and_its_group_memory_read() -> None:
    """`corral bench serve` reads each server's memory (PSS over its processes) through the port it listens on."""
    import socket
    import subprocess
    import sys

    from corral.benchmarks.soak.procinfo import group_pss_mb, listening_pid

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code = (f"import socket, subprocess, sys, time; s = socket.socket(); s.bind(('127.0.0.1', {port})); s.listen(); "
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); "
            "print('ready', flush=True); time.sleep(30)")
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        assert listening_pid(port) == server.pid
        alone = group_pss_mb(server.pid)
        assert alone is not None and alone > 1.0  # a Python interpreter and its child, each a few MB
    finally:
        server.kill()
        server.wait()
    assert listening_pid(port) is None
