"""The server's side of the compile processes (what runs in them is corral/grammar_engines/worker_process.py): starting
a
worker (forked ready from the zygote, or spawned to build its own tables), killing, stopping and reaping it,
and keeping the zygote booted."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import time
from multiprocessing import reduction
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnProcess

from corral.grammar_engines.pipe_protocol import FORK, Job, Reply, await_ready
from corral.grammar_engines.sandbox_errors import SandboxUnavailable
from corral.grammar_engines.worker_process import worker_main, zygote_main

log = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0  # booting a worker (imports + tokenizer tables) on a busy host
_CTX = multiprocessing.get_context("spawn")
CAN_FORK = hasattr(os, "fork") and hasattr(reduction, "send_handle")  # a zygote needs both


_Started = tuple[Connection, SpawnProcess]
_spare: tuple[Connection, SpawnProcess, int | None] | None = None  # a zygote started ahead of its blob
_spare_lock = threading.Lock()


def _spawn_zygote(blob: bytes | None, memory_limit_mb: int | None) -> _Started:
    conn, child = _CTX.Pipe()
    process = _CTX.Process(
        target=zygote_main, args=(child, blob, memory_limit_mb), name="corral-compile-zygote", daemon=True
    )
    process.start()
    child.close()
    return conn, process


def prespawn_zygote(memory_limit_mb: int | None) -> None:
    """Start the compile zygote's process before the tokenizer exists: its interpreter start and imports
    (~3-4 s) then run while the server loads its model, and the first zygote the server needs (with the same
    memory limit) adopts it. Nothing where workers cannot be forked."""
    global _spare
    if not CAN_FORK:
        return
    with _spare_lock:
        if _spare is None:
            _spare = (*_spawn_zygote(None, memory_limit_mb), memory_limit_mb)


def _adopt_spare(blob: bytes, memory_limit_mb: int | None) -> _Started | None:
    """The zygote started ahead, given its blob; None if there is none that fits (one that does not is stopped)."""
    global _spare
    with _spare_lock:
        spare, _spare = _spare, None
    if spare is None:
        return None
    conn, process, limit = spare
    if limit == memory_limit_mb and process.is_alive():
        try:
            conn.send_bytes(blob)
            return conn, process
        except OSError:
            pass  # it died just now: start another
    with contextlib.suppress(OSError):
        conn.close()
    process.kill()
    process.join(5)
    return None


class Zygote:
    """Parent side of the zygote process (`zygote_main`): forks ready workers on request."""

    def __init__(self, blob: bytes, memory_limit_mb: int | None) -> None:
        self.conn, self.process = _adopt_spare(blob, memory_limit_mb) or _spawn_zygote(blob, memory_limit_mb)
        self._lock = threading.Lock()  # one fork conversation at a time
        self.ready = False

    def wait_ready(self, timeout_s: float) -> None:
        if self.ready:
            return
        message = await_ready(self.conn, "compile zygote", timeout_s, lambda: None)
        log.info("compile zygote %s ready (tables built in %.1f s): workers are forked from it", message[1], message[2])
        self.ready = True

    def fork(self, worker_end: Connection, timeout_s: float) -> int:
        """A new worker serving on `worker_end` (the caller keeps the other end); returns its pid."""
        pid = self.process.pid
        assert pid is not None
        with self._lock:
            self.conn.send((FORK,))
            reduction.send_handle(self.conn, worker_end.fileno(), pid)
            if not self.conn.poll(timeout_s):
                raise SandboxUnavailable(f"compile zygote did not fork within {timeout_s:g} s")
            message = self.conn.recv()
        forked: int = message[1]
        return forked

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.conn.send(None)
        with contextlib.suppress(ValueError):
            self.process.join(1)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(5)
        with contextlib.suppress(OSError):
            self.conn.close()


class Worker:
    """One compile worker: spawned (booting its own tables), or forked ready from the zygote."""

    def __init__(self, blob: bytes, memory_limit_mb: int | None, index: int, zygote: Zygote | None = None) -> None:
        self.conn, child = _CTX.Pipe()
        self.process: SpawnProcess | None = None
        self._exitcode: int | None = None
        try:
            if zygote is not None:
                self._pid: int | None = zygote.fork(child, START_TIMEOUT_S)
            else:
                self.process = _CTX.Process(
                    target=worker_main,
                    args=(child, blob, memory_limit_mb),
                    name=f"corral-compile-{index}",
                    daemon=True,  # multiprocessing's atexit hook terminates daemonic children
                )
                self.process.start()
                self._pid = self.process.pid  # kept: the process object is closed once the worker has ended
        except BaseException:
            self.conn.close()
            raise
        finally:
            child.close()
        self.ready = False
        # close() (server stopping) and the compile thread that sees the worker die both end it: close once.
        self._closing = threading.Lock()

    @property
    def pid(self) -> int | None:
        return self._pid

    @property
    def exitcode(self) -> int | None:
        return self._exitcode if self._exitcode is not None else self._live_exitcode()

    def _live_exitcode(self) -> int | None:
        if self.process is None:  # forked: the zygote reaps it, so only "gone" is known
            return self._exitcode
        try:
            return self.process.exitcode
        except ValueError:  # closed
            return self._exitcode

    def _forked_alive(self) -> bool:
        if self._pid is not None and os.getpid() == 1:
            # In a container the server can be PID 1: a worker whose zygote died is then our child, and only
            # we can reap it (else it stays a zombie that os.kill still finds).
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self._pid, os.WNOHANG)
        try:
            os.kill(self._pid or 0, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # the pid was reused by another user's process: ours is gone
            return False
        return self._pid is not None

    def wait_ready(self, timeout_s: float) -> None:
        if self.ready:
            return
        message = await_ready(self.conn, "compile worker", timeout_s, lambda: self.exitcode)
        log.debug("compile worker %s ready (tables built in %.1f s)", message[1], message[2])
        self.ready = True

    def request(self, job: Job, timeout_s: float) -> Reply | None:
        """The worker's reply; None on timeout. Raises EOFError when the worker died."""
        self.conn.send(job)
        if not self.conn.poll(max(0.0, timeout_s)):
            return None
        reply: Reply = self.conn.recv()
        return reply

    def kill(self) -> None:
        if self.process is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if self._pid is not None and self._forked_alive():
                    os.kill(self._pid, signal.SIGKILL)
                    self._exitcode = -signal.SIGKILL
            deadline = time.monotonic() + 5  # as join(5) for a spawned one: gone (reaped) when we return
            while self._forked_alive() and time.monotonic() < deadline:
                time.sleep(0.005)
        else:
            with contextlib.suppress(ValueError):  # ValueError: already ended and closed
                with contextlib.suppress(OSError):
                    self.process.kill()
                self.process.join(5)
        self._close_conn()

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.conn.send(None)
        if self.process is None:
            deadline = time.monotonic() + 1
            while self._forked_alive() and time.monotonic() < deadline:
                time.sleep(0.01)
            alive = self._forked_alive()
        else:
            try:
                self.process.join(1)
                alive = self.process.is_alive()
            except ValueError:  # already ended and closed
                alive = False
        if alive:
            self.kill()
        else:
            self._close_conn()

    def _close_conn(self) -> None:
        with self._closing:
            if not self.conn.closed:
                self.conn.close()
            # Release the process's own pipe (its sentinel) now: a cached refusal's traceback can keep this
            # worker referenced long after it died, and each kept one held file descriptors.
            code = self._live_exitcode()
            if code is not None and self.process is not None:
                self._exitcode = code
                with contextlib.suppress(ValueError):
                    self.process.close()


def stop_all(workers: list[Worker], zygotes: list[Zygote] | None = None) -> None:
    for worker in list(workers):
        worker.stop()
    workers.clear()
    for zygote in list(zygotes or ()):
        zygote.stop()
    if zygotes is not None:
        zygotes.clear()


class WorkerSource:
    """Makes compile workers: forked from the zygote where the platform can (booted on first use, booted
    again when it died), else spawned one by one, each building its own tables. The zygote is off for
    good once it could not start (`error`)."""

    def __init__(self, memory_limit_mb: int | None, start_timeout_s: float, *, fork: bool) -> None:
        self.memory_limit_mb = memory_limit_mb
        self.start_timeout_s = start_timeout_s
        self.fork = fork and CAN_FORK
        self.zygotes: list[Zygote] = []  # the live one, if any (a list: the sandbox's finalizer holds it)
        self.error: str | None = None
        self.closed = False  # set by a final close: no zygote boots again
        self._lock = threading.Lock()

    @property
    def forking(self) -> bool:
        return self.fork and self.error is None

    @property
    def zygote_pid(self) -> int | None:
        with self._lock:
            return self.zygotes[0].process.pid if self.zygotes and self.zygotes[0].ready else None

    def new_worker(self, blob: bytes, index: int) -> Worker:
        zygote = self._ready_zygote(blob)
        if zygote is not None:
            try:
                return Worker(blob, self.memory_limit_mb, index, zygote)
            except Exception as exc:
                if zygote.process.is_alive():
                    raise  # out of processes or memory: a spawn would fail the same way
                # The zygote died (killed from outside?): spawn this worker; the next boots a new zygote.
                log.warning("forking a compile worker failed (%s: %s); spawning one", type(exc).__name__, exc)
                with self._lock:
                    if zygote in self.zygotes:
                        self.zygotes.remove(zygote)
                zygote.stop()
        return Worker(blob, self.memory_limit_mb, index)

    def detach_zygotes(self) -> list[Zygote]:
        """The zygote, one still booting included, for the caller to stop; the next worker boots a new one
        (unless `closed`)."""
        zygotes = list(self.zygotes)
        self.zygotes.clear()
        return zygotes

    def _ready_zygote(self, blob: bytes) -> Zygote | None:
        """The zygote, booted on first use; None where forking is off or the zygote could not start."""
        with self._lock:
            if not self.forking or self.closed:
                return None
            zygote = self.zygotes[0] if self.zygotes else None
            if zygote is not None and not zygote.process.is_alive():
                self.zygotes.clear()
                zygote.stop()
                zygote = None
            if zygote is None:
                zygote = Zygote(blob, self.memory_limit_mb)
                self.zygotes.append(zygote)
            try:
                zygote.wait_ready(self.start_timeout_s)
            except SandboxUnavailable as exc:
                log.warning("compile workers are spawned one by one (no zygote): %s", exc)
                self.error = str(exc)
                self.zygotes.clear()
                zygote.stop()
                return None
            return zygote
