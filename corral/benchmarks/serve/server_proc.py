"""Start a corral server as a subprocess for the benchmark (when no --server is given) and stop it after."""

from __future__ import annotations

import logging
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType

import httpx

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_healthy(base_url: str, timeout_s: float, process: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    # One client for every poll: a new one loads the CA bundle each time (~0.03 s of CPU, taken from the server
    # that is starting).
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"the server exited with status {process.returncode} before it was healthy")
            try:
                if client.get(f"{base_url}/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
    raise RuntimeError(f"{base_url}/health did not answer 200 within {timeout_s:g} s")


class ManagedServer:
    """`python -m corral.server.cli serve --port <free> <extra args>`; its output goes to `log_path`."""

    def __init__(self, extra_args: str, log_path: Path, startup_timeout_s: float = 300.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        extra = shlex.split(extra_args)
        # Benchmarks measure the serving machinery on the tiny model unless told which model to serve.
        model = [] if any(a == "--model" or a.startswith("--model=") for a in extra) else ["--model", "corral-tiny"]
        self.command = [sys.executable, "-m", "corral.server.cli", "serve", "--port", str(self.port),
                        "--log-level", "warning", *model, *extra]
        self._log_path = log_path
        self._startup_timeout_s = startup_timeout_s
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ManagedServer:
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        log.info("starting %s", shlex.join(self.command))
        with self._log_path.open("wb") as sink:
            self._process = subprocess.Popen(self.command, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT)
        try:
            wait_healthy(self.url, self._startup_timeout_s, self._process)
        except RuntimeError as exc:
            self.stop()
            tail = self._log_path.read_text(encoding="utf-8", errors="replace")[-2000:]
            raise RuntimeError(f"{exc}; server log ({self._log_path}):\n{tail}") from exc
        return self

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            log.warning("server did not stop within 15 s; killing it")
            process.kill()
            process.wait(timeout=15)


@contextmanager
def corral_server(url: str | None, server_args: str, log_path: Path) -> Iterator[tuple[str, list[str] | None]]:
    """(base URL, command): the running server at `url` once healthy, or a ManagedServer started for the
    duration (its command, for results.json)."""
    if url:
        wait_healthy(url.rstrip("/"), 10.0)
        yield url.rstrip("/"), None
        return
    with ManagedServer(server_args, log_path) as server:
        yield server.url, server.command
