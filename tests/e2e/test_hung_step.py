"""A hung engine step: in-flight requests get an error response, /health turns 503, and the process
exits (status 70) so a supervisor restarts it."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

SCRIPT = Path(__file__).with_name("hung_server.py")


def test_hung_step_fails_in_flight_requests_and_exits() -> None:
    proc = subprocess.Popen([sys.executable, str(SCRIPT)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        base = proc.stdout.readline().strip()
        assert base.startswith("http://127.0.0.1:"), base
        health_during: list[int] = []

        def probe_health() -> None:
            while proc.poll() is None:
                with contextlib.suppress(httpx.HTTPError):
                    health_during.append(httpx.get(f"{base}/health", timeout=0.5).status_code)
                time.sleep(0.1)

        prober = threading.Thread(target=probe_health, daemon=True)
        prober.start()
        started = time.monotonic()
        resp = httpx.post(
            f"{base}/v1/chat/completions",
            timeout=30,
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5},
        )
        elapsed = time.monotonic() - started
        assert resp.status_code == 503
        assert resp.json()["error"]["code"] == "engine_hung"
        assert elapsed < 6, f"the in-flight request waited {elapsed:.1f} s"
        print(f"\nhung_step: in-flight request answered 503 after {elapsed:.2f} s (deadline 1 s)")
        assert proc.wait(timeout=15) == 70
        prober.join(timeout=5)
        assert 503 in health_during
    finally:
        if proc.poll() is None:
            proc.kill()
