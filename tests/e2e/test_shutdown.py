"""`corral serve` stops promptly on Ctrl-C (SIGINT) and on SIGTERM (docker stop, systemd, k8s), after it has
compiled grammars in its worker processes and while a request's compile is still running under a 60 s deadline:
the drain is bounded (--shutdown-timeout-s, 2 s here), the compile is stopped, and no process is left behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from corral.benchmarks.serve.server_proc import free_port, wait_healthy

REPO = Path(__file__).resolve().parents[2]
EXIT_WITHIN_S = 30.0
# Keeps a compile worker busy far past the second the test waits before signalling (the regex the compile
# deadline tests use; the server here allows it 60 s).
HOSTILE_REGEX = "".join(f"[a-z]{{1,{i + 50}}}" for i in range(300))


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def _alive(pid: int) -> bool:
    return _state(pid) not in (None, "Z")


def _cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _descendants(pid: int) -> set[int]:
    """Live (non-zombie) processes under `pid`, read from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if fields[0] != "Z":
            parents[int(entry.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _start(port: int) -> subprocess.Popen[bytes]:
    env = dict(os.environ, CORRAL_PORT=str(port), CORRAL_COMPILE_TIMEOUT_S="60", CORRAL_LOG_LEVEL="warning",
               CORRAL_SHUTDOWN_TIMEOUT_S="2")
    return subprocess.Popen(
        [sys.executable, "-m", "corral.server.cli", "serve"], cwd=REPO, env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )


def _post(base: str, structured: dict[str, object]) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "structured_outputs": structured}
    return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)


def _post_until_cut(base: str, structured: dict[str, object]) -> None:
    with contextlib.suppress(httpx.HTTPError):  # the server cuts it: --shutdown-timeout-s
        _post(base, structured)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_server_stops_promptly_and_leaves_no_process(sig: signal.Signals) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = _start(port)
    try:
        wait_healthy(base, 180, proc)
        assert _post(base, {"json": {"type": "object", "properties": {"n": {"type": "integer"}}}}).status_code == 200
        assert _post(base, {"choice": ["yes", "no"], "backend": "xgrammar"}).status_code == 200
        workers = _descendants(proc.pid)
        assert workers, "the server should compile in worker processes"

        # A compile in flight when the signal arrives must not hold the exit up.
        hostile = threading.Thread(target=_post_until_cut, args=(base, {"regex": HOSTILE_REGEX}), daemon=True)
        used = {pid: _cpu_seconds(pid) for pid in workers}
        hostile.start()
        time.sleep(1.5)
        assert any(_cpu_seconds(pid) - used[pid] > 0.3 for pid in workers), "no worker is compiling the regex"
        started = time.monotonic()
        proc.send_signal(sig)
        status = proc.wait(timeout=EXIT_WITHIN_S)
        elapsed = time.monotonic() - started
        assert status in (0, -sig), f"exit status {status}"
        deadline = time.monotonic() + 5  # a worker notices its parent is gone within 0.5 s
        while (left := {pid for pid in workers if _alive(pid)}) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, f"compile workers outlived the server: {sorted(left)}"
        print(f"\nshutdown on {sig.name}: exited {status} after {elapsed:.2f} s, {len(workers)} workers gone")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
