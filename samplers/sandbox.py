"""Grammar compilation in worker processes that can be killed at a deadline.

A native compile (xgrammar, llguidance) cannot be interrupted from Python, and a thread that runs one
keeps burning a core after its caller gave up. So the expensive part runs in a small pool of worker
processes; a compile that overruns its deadline is SIGKILLed and its worker replaced.

Design choices:
- The server never forks itself: it has threads (event loop, engine, compile pool) and forking a threaded
  process can deadlock the child on a lock some other thread held. It spawns; only the zygote (below), a
  spawned process that runs nothing but idle library threads, forks.
- Persistent workers (default 2, the server's compile parallelism), each holding every enabled built-in
  backend: building the tokenizer tables costs seconds (llguidance ~4 s, xgrammar ~1 s for the 128k
  Llama-3 vocabulary), far too much to pay per compile. A worker reports "ready" only once its tables
  are built; waiting for that (or for a free worker) is not charged to the compile deadline.
- Workers are forked from a zygote: one spawned process that builds the tables once and then forks a
  ready worker on request (~0.1 s), so a worker killed by a compile bomb's deadline is replaced without
  a new table build; a flood of bombs costs their deadlines, not a boot each. The zygote never compiles,
  and proves at boot that a forked child compiles; if it cannot (or where fork is unavailable) workers
  are spawned one by one as before. A killed worker is replaced at once in the background, and the pool
  keeps `spares` workers beyond the compile parallelism (the server: one), so a compile bomb's kill
  never makes ordinary compiles wait for a replacement.
- A worker that cannot be spawned at all (no memory, no process slots) is not retried in a loop: a
  compile waiting for one is told at once (SandboxUnavailable), and a new spawn is tried only after
  RESPAWN_BACKOFF_S.
- What comes back: the worker compiles under the deadline; the parent then needs its own copy.
  xgrammar ships small grammars as `CompiledGrammar.serialize_json()` (deserialised with the parent's
  TokenizerInfo: ~0.1 ms for a choice, ~2 ms for a small schema); for big ones serialising costs more
  than compiling (see XGRAMMAR_SHIP_LIMIT_BYTES), so the parent compiles again. llguidance has no
  serialisation; building its matcher takes ms, so the parent always builds it again. Either way the
  parent repeats only work that just finished within the deadline, so it is bounded: a refusal comes
  at the deadline, a success within ~2x the deadline at worst.
- Each worker caps its own address space (RLIMIT_AS, `memory_limit_mb` above what it holds once ready)
  so a compile that explodes in memory fails in the worker (CompileOutOfMemory, its own error code)
  instead of waking the OOM killer on the host; and exits when its parent disappears.
Backends without a codec here (plug-ins, test doubles) compile in the caller's thread as before.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import pickle
import resource
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing import reduction
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnProcess
from typing import Any, Protocol

from grammars.spec import GrammarKind, GrammarSpec
from samplers.protocol import CompiledGrammar, CompileError, SamplerBackend, TokenizerSpec

log = logging.getLogger(__name__)

DEFAULT_WORKERS = 2
DEFAULT_MEMORY_LIMIT_MB = 4096  # per compile worker, on top of what it holds once ready
START_TIMEOUT_S = 300.0  # booting a worker (imports + tokenizer tables) on a busy host
RESPAWN_BACKOFF_S = 5.0  # after a worker failed to spawn, compiles go without one for this long
_CTX = multiprocessing.get_context("spawn")


class CompileTimeout(CompileError):
    """The compile overran its deadline; the worker running it was killed."""

    def __init__(self, message: str, *, backend: str, deadline_s: float) -> None:
        super().__init__(message, backend=backend)
        self.deadline_s = deadline_s


class CompileOutOfMemory(CompileError):
    """The compile needed more memory than a worker may use (`memory_limit_mb`); the worker was replaced."""

    def __init__(self, message: str, *, backend: str, limit_mb: int | None) -> None:
        super().__init__(message, backend=backend)
        self.limit_mb = limit_mb


class CompileStopped(CompileError):
    """The sandbox was shut down (the server is stopping): no compile starts or finishes any more."""


STOPPED = "compiling stopped: the server is shutting down"


class SandboxUnavailable(RuntimeError):
    """A worker process could not start; callers fall back to compiling in-process."""


class Budget:
    """Compile seconds left for one request. Only compiling is charged, not waiting for a worker."""

    def __init__(self, seconds: float) -> None:
        self.total = seconds
        self.spent = 0.0

    @property
    def remaining(self) -> float:
        return self.total - self.spent

    @contextlib.contextmanager
    def charging(self) -> Iterator[None]:
        start = time.monotonic()
        try:
            yield
        finally:
            self.spent += time.monotonic() - start


# -- codecs: how one backend's compiled grammar crosses the process boundary -------------------------------


class Codec(Protocol):
    def handles(self, impl: SamplerBackend) -> bool:
        """True when `impl` is the class the worker builds for this backend name."""

    def export(self, compiled: CompiledGrammar) -> Any:
        """In the worker: a picklable payload for `restore`, or None when rebuilding is cheaper."""

    def restore(self, impl: SamplerBackend, spec: GrammarSpec, payload: Any) -> CompiledGrammar:
        """In the parent: the compiled grammar, equivalent to `impl.compile(spec)`. Without a payload
        it compiles again in-process: the worker just did the same work within the deadline, so this
        is bounded (a success can thus take up to ~2x the deadline; a refusal never does)."""


# xgrammar's JSON serialisation is slow for grammars with a large token-mask cache: a 1 KB schema
# (Github_medium/o83393) compiles in 1.1 s, serialises to 15 MB in 1.0 s and deserialises in 0.35 s,
# while a small schema (0.13 MB in memory) compiles in 17 ms and round-trips in 7 ms. Ship it only
# while small; otherwise the parent compiles again.
XGRAMMAR_SHIP_LIMIT_BYTES = 1 << 20


class _XGrammarCodec:
    def __init__(self) -> None:
        self._info: Any = None
        self._lock = threading.Lock()

    def handles(self, impl: SamplerBackend) -> bool:
        from samplers.xgrammar_backend import XGrammarBackend

        return type(impl) is XGrammarBackend

    def export(self, compiled: CompiledGrammar) -> Any:
        grammar = compiled.grammar  # type: ignore[attr-defined]
        return grammar.serialize_json() if grammar.memory_size_bytes < XGRAMMAR_SHIP_LIMIT_BYTES else None

    def restore(self, impl: SamplerBackend, spec: GrammarSpec, payload: Any) -> CompiledGrammar:
        import xgrammar

        from samplers.xgrammar_backend import XGrammarCompiled

        if payload is None:
            return impl.compile(spec)
        return XGrammarCompiled(spec, xgrammar.CompiledGrammar.deserialize_json(payload, self._tokenizer_info(impl)))

    def _tokenizer_info(self, impl: SamplerBackend) -> Any:
        # The backend keeps its TokenizerInfo private; a one-character regex compiles in ~1 ms and
        # hands it over through xgrammar's public API.
        with self._lock:
            if self._info is None:
                self._info = impl.compile(GrammarSpec(GrammarKind.REGEX, "a")).grammar.tokenizer_info  # type: ignore[attr-defined]
            return self._info


class _LLGuidanceCodec:
    def handles(self, impl: SamplerBackend) -> bool:
        from samplers.llguidance_backend import LLGuidanceBackend

        return type(impl) is LLGuidanceBackend

    def export(self, compiled: CompiledGrammar) -> Any:
        return None

    def restore(self, impl: SamplerBackend, spec: GrammarSpec, payload: Any) -> CompiledGrammar:
        return impl.compile(spec)  # no serialisation in llguidance; building a matcher takes ms


_CODECS: dict[str, Callable[[], Codec]] = {"xgrammar": _XGrammarCodec, "llguidance": _LLGuidanceCodec}


# -- the worker process ------------------------------------------------------------------------------------


def _boot(tokenizer_blob: bytes, names: list[str]) -> tuple[dict[str, SamplerBackend], dict[str, Codec]]:
    from samplers.registry import resolve_factory

    tokenizer: TokenizerSpec = pickle.loads(tokenizer_blob)
    backends = {name: resolve_factory(name)(tokenizer) for name in names}
    return backends, {name: _CODECS[name]() for name in names}


def _worker_main(conn: Connection, tokenizer_blob: bytes, names: list[str], memory_limit_mb: int | None) -> None:
    booted = time.monotonic()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the server; it stops us
    _exit_with_parent(os.getppid())
    try:
        backends, codecs = _boot(tokenizer_blob, names)
    except BaseException as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    _limit_memory(memory_limit_mb)
    conn.send(("ready", os.getpid(), time.monotonic() - booted))
    _serve(conn, backends, codecs)


def _serve(conn: Connection, backends: dict[str, SamplerBackend], codecs: dict[str, Codec]) -> None:
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        name, spec = job
        try:
            reply: tuple[Any, ...] = ("ok", codecs[name].export(backends[name].compile(spec)))
        except CompileError as exc:  # xgrammar reports an allocation failure as a RuntimeError
            reply = ("oom",) if "bad_alloc" in str(exc) else ("refused", str(exc), exc.unsupported)
        except MemoryError:
            reply = ("oom",)
        except Exception as exc:
            text = f"{type(exc).__name__}: {exc}"
            reply = ("oom",) if "bad_alloc" in text else ("crashed", text)
        try:
            conn.send(reply)
        except MemoryError:
            conn.send(("oom",))


# Compiled in a forked child before the zygote says it is ready: forking must give a working worker.
_FORK_PROBES = (GrammarSpec(GrammarKind.REGEX, "[a-z]{1,4}"), GrammarSpec(GrammarKind.JSON_SCHEMA, '{"type":"object"}'))
FORK_PROBE_TIMEOUT_S = 60.0


def _zygote_main(conn: Connection, tokenizer_blob: bytes, names: list[str], memory_limit_mb: int | None) -> None:
    """Build the backends' tables once, then fork ready workers from them on request (~0.1 s each instead
    of a ~5-8 s boot per worker). Every worker a compile bomb's deadline kills is replaced this way, so
    refusing a flood of bombs costs their deadlines, not a table build each. The zygote never compiles
    itself; it is single-threaded apart from idle library threads, and it proves a forked child can
    compile (`_FORK_PROBES`) before it reports ready, else the pool spawns workers as before."""
    booted = time.monotonic()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent(os.getppid())
    try:
        backends, codecs = _boot(tokenizer_blob, names)
        _probe_fork(backends)
    except BaseException as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the workers (they are not the server's)
    conn.send(("ready", os.getpid(), time.monotonic() - booted))
    while True:
        try:
            request = conn.recv()
            if request is None:
                return
            fd = reduction.recv_handle(conn)
        except (EOFError, OSError):
            return
        pid = os.fork()
        if pid == 0:  # the worker: serve on the pipe end the server sent
            try:
                conn.close()
                worker_conn = Connection(fd)
                _exit_with_parent(os.getppid())
                _limit_memory(memory_limit_mb)
                worker_conn.send(("ready", os.getpid(), 0.0))
                _serve(worker_conn, backends, codecs)
            finally:
                os._exit(0)
        os.close(fd)
        conn.send(("forked", pid))


def _probe_fork(backends: dict[str, SamplerBackend]) -> None:
    """Raise unless a child forked now compiles every probe with every backend within the timeout."""
    pid = os.fork()
    if pid == 0:
        try:
            for backend in backends.values():
                for spec in _FORK_PROBES:
                    backend.compile(spec)
        except BaseException:
            os._exit(1)
        os._exit(0)
    deadline = time.monotonic() + FORK_PROBE_TIMEOUT_S
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            if os.waitstatus_to_exitcode(status) != 0:
                raise RuntimeError("a forked compile worker could not compile the probe grammars")
            return
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise RuntimeError(f"a forked compile worker did not compile the probe grammars in {FORK_PROBE_TIMEOUT_S:g} s")


def _exit_with_parent(parent: int) -> None:
    """A SIGKILLed server leaves no orphan burning a core on a hostile compile."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="corral-parent-watch", daemon=True).start()


def _limit_memory(limit_mb: int | None) -> None:
    if limit_mb is None:
        return
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            size_kb = next(int(line.split()[1]) for line in status if line.startswith("VmSize:"))
    except (OSError, StopIteration, ValueError):
        return  # not Linux: no cap
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    soft = size_kb * 1024 + limit_mb * 2**20
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _await_ready(conn: Connection, what: str, timeout_s: float, exitcode: Callable[[], int | None]) -> tuple[Any, ...]:
    """The ("ready", pid, seconds) message a starting process sends; SandboxUnavailable otherwise."""
    if not conn.poll(timeout_s):
        raise SandboxUnavailable(f"{what} did not start within {timeout_s:g} s")
    try:
        message: tuple[Any, ...] = conn.recv()
    except (EOFError, OSError) as exc:
        raise SandboxUnavailable(f"{what} died while starting (exit code {exitcode()})") from exc
    if message[0] != "ready":
        raise SandboxUnavailable(f"{what} failed to start: {message[1]}")
    return message


class _Zygote:
    """Parent side of the zygote process (`_zygote_main`): forks ready workers on request."""

    def __init__(self, blob: bytes, names: list[str], memory_limit_mb: int | None) -> None:
        self.conn, child = _CTX.Pipe()
        self.process: SpawnProcess = _CTX.Process(
            target=_zygote_main, args=(child, blob, names, memory_limit_mb), name="corral-compile-zygote", daemon=True
        )
        self.process.start()
        child.close()
        self._lock = threading.Lock()  # one fork conversation at a time
        self.ready = False

    def wait_ready(self, timeout_s: float) -> None:
        if self.ready:
            return
        message = _await_ready(self.conn, "compile zygote", timeout_s, lambda: None)
        log.info("compile zygote %s ready (tables built in %.1f s): workers are forked from it", message[1], message[2])
        self.ready = True

    def fork(self, worker_end: Connection, timeout_s: float) -> int:
        """A new worker serving on `worker_end` (the caller keeps the other end); returns its pid."""
        pid = self.process.pid
        assert pid is not None
        with self._lock:
            self.conn.send(("fork",))
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


class _Worker:
    """One compile worker: spawned (booting its own tables), or forked ready from the zygote."""

    def __init__(
        self, blob: bytes, names: list[str], memory_limit_mb: int | None, index: int, zygote: _Zygote | None = None
    ) -> None:
        self.conn, child = _CTX.Pipe()
        self.process: SpawnProcess | None = None
        self._exitcode: int | None = None
        try:
            if zygote is not None:
                self._pid: int | None = zygote.fork(child, START_TIMEOUT_S)
            else:
                self.process = _CTX.Process(
                    target=_worker_main,
                    args=(child, blob, names, memory_limit_mb),
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
        message = _await_ready(self.conn, "compile worker", timeout_s, lambda: self.exitcode)
        log.debug("compile worker %s ready (tables built in %.1f s)", message[1], message[2])
        self.ready = True

    def request(self, job: tuple[str, GrammarSpec], timeout_s: float) -> tuple[Any, ...] | None:
        """The worker's reply; None on timeout. Raises EOFError when the worker died."""
        self.conn.send(job)
        if not self.conn.poll(max(0.0, timeout_s)):
            return None
        reply: tuple[Any, ...] = self.conn.recv()
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


def _stop_all(workers: list[_Worker], zygotes: list[_Zygote] | None = None) -> None:
    for worker in list(workers):
        worker.stop()
    workers.clear()
    for zygote in list(zygotes or ()):
        zygote.stop()
    if zygotes is not None:
        zygotes.clear()


@dataclass(frozen=True)
class SandboxStats:
    started: int
    killed: int
    crashed: int


class CompileSandbox:
    """A pool of killable compile workers for one tokenizer. Thread-safe; workers start lazily."""

    def __init__(
        self,
        tokenizer: TokenizerSpec,
        names: Sequence[str],
        *,
        workers: int = DEFAULT_WORKERS,
        spares: int = 0,
        memory_limit_mb: int | None = DEFAULT_MEMORY_LIMIT_MB,
        start_timeout_s: float = START_TIMEOUT_S,
        fork_workers: bool = True,
    ) -> None:
        if workers < 1 or spares < 0:
            raise ValueError("a compile sandbox needs at least one worker (and no negative spares)")
        self.tokenizer = tokenizer
        self.names = [n for n in names if n in _CODECS]
        self.size = workers + spares  # `workers` compile at once (the caller's parallelism); spares stand by
        self.memory_limit_mb = memory_limit_mb
        self.start_timeout_s = start_timeout_s
        self._codecs = {name: _CODECS[name]() for name in self.names}
        self._blob: bytes | None = None
        self._workers: list[_Worker] = []  # every live worker, idle or busy
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)  # notified when a worker joins _idle
        self._broken: str | None = None
        self._closed = False  # close(final=True): refuse compiles instead of starting workers again
        self._booting = 0  # workers being spawned, not yet in _workers
        self._spawn_error: str | None = None  # why the last spawn failed (cleared by a successful one)
        self._spawn_failed_at = 0.0  # monotonic time of that failure
        self._generation = 0  # bumped by close(): a worker that finishes booting after it is stopped
        self._started = self._killed = self._crashed = 0
        # Workers are forked from a zygote where the platform can (Linux); `_zygote_error` turns that off.
        self._fork = fork_workers and hasattr(os, "fork") and hasattr(reduction, "send_handle")
        self._zygotes: list[_Zygote] = []  # the live one, if any (a list: the finalizer holds it)
        self._zygote_lock = threading.Lock()
        self._zygote_error: str | None = None
        self._finalizer = weakref.finalize(self, _stop_all, self._workers, self._zygotes)

    def handles(self, impl: SamplerBackend) -> bool:
        codec = self._codecs.get(impl.name)
        return self._broken is None and codec is not None and codec.handles(impl)

    def start(self) -> None:
        """Boot the workers now (e.g. at server warm-up) instead of on the first compile; returns at once."""
        with self._lock:
            if self._closed or self._backing_off():
                return
            missing = self.size - len(self._workers) - self._booting
            self._booting += missing
        for _ in range(missing):
            self._spawn_in_background()

    def wait_ready(self, count: int | None = None) -> None:
        """Start the workers and block until `count` of them (default: all) have built their tables."""
        self.start()
        taken: list[_Worker] = []
        try:
            for _ in range(min(count or self.size, self.size)):
                worker = self._acquire()
                if worker is not None:
                    taken.append(worker)
            for worker in taken:
                worker.wait_ready(self.start_timeout_s)
        finally:
            for worker in taken:
                self._release(worker)

    def close(self, *, final: bool = False) -> None:
        """Stop every worker. A later compile starts fresh ones, unless `final` (a server stopping): then
        compiles in flight end with CompileStopped at once instead of booting workers for their next
        attempt, and so does every later one."""
        with self._lock:
            self._closed = self._closed or final
            self._generation += 1
            _stop_all(self._workers)
            self._idle.clear()
            zygotes = list(self._zygotes)
            self._zygotes.clear()
            self._freed.notify_all()  # waiters for a worker see the close at once
        for zygote in zygotes:
            zygote.stop()

    @property
    def zygote_pid(self) -> int | None:
        """The process new workers are forked from, once booted."""
        with self._zygote_lock:
            return self._zygotes[0].process.pid if self._zygotes and self._zygotes[0].ready else None

    @property
    def forking(self) -> bool:
        """Whether new workers come from the zygote (else each is spawned and builds its own tables)."""
        return self._fork and self._zygote_error is None

    def pids(self, *, ready_only: bool = False) -> list[int]:
        """Live workers' process ids (`ready_only`: those done building their tables)."""
        with self._lock:
            workers = [w for w in self._workers if not ready_only or w.ready or w.conn.poll(0)]
            return [w.pid for w in workers if w.pid is not None]

    @property
    def stats(self) -> SandboxStats:
        return SandboxStats(self._started, self._killed, self._crashed)

    def compile(self, impl: SamplerBackend, spec: GrammarSpec, budget: Budget) -> CompiledGrammar:
        """Compile `spec` with `impl`'s twin in a worker. Raises CompileTimeout, CompileError or
        SandboxUnavailable (the caller then compiles in-process)."""
        codec = self._codecs[impl.name]
        worker = self._ready_worker(impl.name)
        done = False
        try:
            with budget.charging():
                if budget.remaining <= 0:
                    reply = None
                else:
                    try:
                        reply = worker.request((impl.name, spec), budget.remaining)
                    except (EOFError, OSError):
                        reply = ("died",)
            if reply is None:
                self._replace(worker, killed=True)
                done = True
                raise CompileTimeout(
                    f"compiling took longer than the {budget.total:g} s deadline; {impl.name} was stopped",
                    backend=impl.name,
                    deadline_s=budget.total,
                )
            if reply[0] in ("oom", "crashed", "died"):
                self._replace(worker, killed=False)
                done = True
                if self._closed:  # killed by close(final=True), not by the grammar
                    raise CompileStopped(STOPPED, backend=impl.name)
                message = self._failure_text(impl.name, reply, worker)
                if reply[0] == "oom":
                    raise CompileOutOfMemory(message, backend=impl.name, limit_mb=self.memory_limit_mb)
                raise CompileError(message, backend=impl.name)
            self._release(worker)
            done = True
            if reply[0] == "refused":
                raise CompileError(reply[1], backend=impl.name, unsupported=bool(reply[2]))
            with budget.charging():
                return codec.restore(impl, spec, reply[1])
        finally:
            if not done:  # an unexpected error between acquire and release: do not lose the slot
                self._replace(worker, killed=True)

    def _failure_text(self, name: str, reply: tuple[Any, ...], worker: _Worker) -> str:
        if reply[0] == "oom":
            return f"{name} needed more than {self.memory_limit_mb} MB to compile this grammar"
        if reply[0] == "crashed":
            return f"{name} failed on this grammar: {reply[1]}"
        return f"{name} crashed compiling this grammar (worker exit code {worker.exitcode})"

    def _ready_worker(self, name: str) -> _Worker:
        if self._broken is not None:
            raise SandboxUnavailable(self._broken)
        self.start()
        worker = self._acquire()
        if worker is None:
            raise CompileStopped(STOPPED, backend=name)
        try:
            worker.wait_ready(self.start_timeout_s)
        except SandboxUnavailable as exc:
            # Deterministic (an unpicklable tokenizer, a missing module): stop trying, compile in-process.
            log.error("grammar compile sandbox unavailable, compiling in-process from now on: %s", exc)
            self._broken = str(exc)
            self._replace(worker, killed=False, respawn=False)
            raise
        return worker

    def _backing_off(self) -> bool:
        """True shortly after a spawn failed (call with the lock held): no new spawn yet."""
        return self._spawn_error is not None and time.monotonic() - self._spawn_failed_at < RESPAWN_BACKOFF_S

    def _acquire(self) -> _Worker | None:
        """An idle worker, preferring one that has finished booting (a replacement may still be
        building its tables while another worker is ready); None once closed for good. Raises
        SandboxUnavailable when no worker exists and none could be spawned, or none came free in
        `start_timeout_s`: a compile is never left waiting on a pool that cannot fill."""
        deadline = time.monotonic() + self.start_timeout_s
        with self._freed:
            while not self._idle:
                if self._closed:
                    return None
                if self._spawn_error is not None and not self._workers and not self._booting:
                    raise SandboxUnavailable(f"no compile worker could be started: {self._spawn_error}")
                if time.monotonic() > deadline:
                    raise SandboxUnavailable(f"no compile worker came free within {self.start_timeout_s:g} s")
                if not self._freed.wait(timeout=1.0) and not self._workers and not self._booting:
                    self._freed.release()  # after close() the pool refills on demand
                    try:
                        self.start()
                    finally:
                        self._freed.acquire()
            for worker in self._idle:
                if worker.ready or worker.conn.poll(0):
                    break
            else:
                worker = self._idle[0]
            self._idle.remove(worker)
            return worker

    def _release(self, worker: _Worker) -> None:
        with self._freed:
            if worker in self._workers:  # not stopped by close() meanwhile
                self._idle.append(worker)
                self._freed.notify()

    def _spawn(self) -> None:
        # Process.start() blocks until the child has read its arguments, i.e. until it has imported
        # this module (torch included, ~2 s): callers that must not wait run this on a thread.
        try:
            with self._lock:
                if self._blob is None:
                    self._blob = pickle.dumps(self.tokenizer)
                blob, index, generation = self._blob, self._started, self._generation
                self._started += 1
            worker = self._new_worker(blob, index)
        except Exception as exc:  # e.g. out of memory or process slots: say so, and let waiters know
            log.error("could not start a compile worker: %s: %s", type(exc).__name__, exc)
            with self._freed:
                self._booting -= 1
                self._spawn_error = f"{type(exc).__name__}: {exc}"
                self._spawn_failed_at = time.monotonic()
                self._freed.notify_all()
            return
        with self._freed:
            self._booting -= 1
            self._spawn_error = None
            stale = generation != self._generation
            if not stale:
                self._workers.append(worker)
                self._idle.append(worker)
                self._freed.notify()
        if stale:
            worker.stop()

    def _new_worker(self, blob: bytes, index: int) -> _Worker:
        zygote = self._ready_zygote(blob)
        if zygote is not None:
            try:
                return _Worker(blob, self.names, self.memory_limit_mb, index, zygote)
            except Exception as exc:
                if zygote.process.is_alive():
                    raise  # out of processes or memory: a spawn would fail the same way
                # The zygote died (killed from outside?): spawn this worker; the next boots a new zygote.
                log.warning("forking a compile worker failed (%s: %s); spawning one", type(exc).__name__, exc)
                with self._zygote_lock:
                    if zygote in self._zygotes:
                        self._zygotes.remove(zygote)
                zygote.stop()
        return _Worker(blob, self.names, self.memory_limit_mb, index)

    def _ready_zygote(self, blob: bytes) -> _Zygote | None:
        """The zygote, booted on first use; None where forking is off or the zygote could not start."""
        with self._zygote_lock:
            if not self.forking or self._closed:
                return None
            zygote = self._zygotes[0] if self._zygotes else None
            if zygote is not None and not zygote.process.is_alive():
                self._zygotes.clear()
                zygote.stop()
                zygote = None
            if zygote is None:
                zygote = _Zygote(blob, self.names, self.memory_limit_mb)
                self._zygotes.append(zygote)
            try:
                zygote.wait_ready(self.start_timeout_s)
            except SandboxUnavailable as exc:
                log.warning("compile workers are spawned one by one (no zygote): %s", exc)
                self._zygote_error = str(exc)
                self._zygotes.clear()
                zygote.stop()
                return None
            return zygote

    def _replace(self, worker: _Worker, *, killed: bool, respawn: bool = True) -> None:
        if killed:
            log.warning("killing compile worker %s", worker.pid)
        worker.kill()
        with self._lock:
            if killed:
                self._killed += 1
            else:
                self._crashed += 1
            if worker not in self._workers:
                return  # stopped by close() meanwhile
            self._workers.remove(worker)
            if not respawn:
                return
            self._booting += 1
        self._spawn_in_background()

    def _spawn_in_background(self) -> None:
        # Not a daemon thread: interpreter exit waits for the spawn to finish (~2 s) rather than cut the
        # child's start-up data short; multiprocessing's exit hook then terminates the child.
        threading.Thread(target=self._spawn, name="corral-compile-spawn").start()
