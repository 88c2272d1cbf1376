"""Grammar compilation in worker processes that can be killed at a deadline.

A native compile (xgrammar, llguidance) cannot be interrupted from Python, and a thread that runs one
keeps burning a core after its caller gave up. So the expensive part runs in a small pool of worker
processes; a compile that overruns its deadline is SIGKILLed and its worker replaced.

The pieces: this module is the pool (who compiles where, deadlines, replacing a worker that died or was
killed); corral/grammar_engines/worker_handles.py starts, kills and reaps the processes and keeps the zygote;
corral/grammar_engines/worker_process.py is what runs in them; corral/grammar_engines/pipe_protocol.py is what they say
to each other;
each backend's codec (its `BackendDescriptor`, corral/grammar_engines/backends/) says how its compiled grammar crosses
back.

Design choices:
- Persistent workers (default 2, the server's compile parallelism), each holding every enabled backend
  that has a codec: building the tokenizer tables costs seconds (llguidance ~4 s, xgrammar ~1 s for the
  128k Llama-3 vocabulary), far too much to pay per compile. A worker reports "ready" only once its tables
  are built; waiting for that (or for a free worker) is not charged to the compile deadline.
- Workers are forked from a zygote: one spawned process that builds the tables once and then forks a
  ready worker on request (~0.1 s), so a worker killed by a compile bomb's deadline is replaced without
  a new table build; a flood of bombs costs their deadlines, not a boot each. The zygote never compiles,
  and proves at boot that a forked child compiles; if it cannot (or where fork is unavailable) workers
  are spawned one by one. A killed worker is replaced at once in the background, and the pool keeps
  `spares` workers beyond the compile parallelism (the server: one), so a compile bomb's kill never makes
  ordinary compiles wait for a replacement.
- A worker that cannot be spawned at all (no memory, no process slots) is not retried in a loop: a
  compile waiting for one is told at once (SandboxUnavailable), and a new spawn is tried only after
  RESPAWN_BACKOFF_S.
- What comes back: the worker compiles under the deadline; the parent then needs its own copy, which the
  backend's codec restores from what the worker exported (xgrammar ships small grammars serialised, and
  llguidance's parent builds again: corral/grammar_engines/backends/). The parent repeats at most work that just
  finished within the deadline, so it is bounded: a refusal comes at the deadline, a success within ~2x
  the deadline at worst.
Backends without a codec (plug-ins that declare none, test doubles) compile in the caller's thread.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NoReturn

from corral.grammar_engines.pipe_protocol import DIED, FAILURES, OOM, REFUSED, Reply
from corral.grammar_engines.protocol import (
    BackendDescriptor,
    Codec,
    CompiledGrammar,
    CompileError,
    SamplerBackend,
    TokenizerSpec,
)
from corral.grammar_engines.registry import find_descriptor
from corral.grammar_engines.sandbox_errors import (
    STOPPED,
    CompileOutOfMemory,
    CompileStopped,
    CompileTimeout,
    SandboxUnavailable,
)
from corral.grammar_engines.worker_handles import START_TIMEOUT_S, Worker, WorkerSource, stop_all
from corral.grammars.spec import GrammarSpec

__all__ = [
    "DEFAULT_MEMORY_LIMIT_MB", "DEFAULT_WORKERS", "RESPAWN_BACKOFF_S", "START_TIMEOUT_S", "STOPPED", "Budget",
    "CompileOutOfMemory", "CompileSandbox", "CompileStopped", "CompileTimeout", "SandboxStats",
    "SandboxUnavailable", "sandboxable",
]

log = logging.getLogger(__name__)

DEFAULT_WORKERS = 2
DEFAULT_MEMORY_LIMIT_MB = 4096  # per compile worker, on top of what it holds once ready
RESPAWN_BACKOFF_S = 5.0  # after a worker failed to spawn, compiles go without one for this long


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


def sandboxable(names: Sequence[str]) -> dict[str, BackendDescriptor]:
    """The descriptors of `names` that a compile worker can run: those with a codec that pickle (a worker
    receives them pickled and imports what they name)."""
    found: dict[str, BackendDescriptor] = {}
    for name in names:
        described = find_descriptor(name)
        if described is None or described.codec is None:
            continue
        try:
            pickle.dumps(described)
        except Exception as exc:
            log.warning("backend %s compiles in-process: its descriptor does not pickle (%s)", name, exc)
            continue
        found[name] = described
    return found


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
        self._descriptors = sandboxable(names)
        self.names = list(self._descriptors)
        self.size = workers + spares  # `workers` compile at once (the caller's parallelism); spares stand by
        self.memory_limit_mb = memory_limit_mb
        self.start_timeout_s = start_timeout_s
        self._codecs: dict[str, Codec] = {}  # made on first use: a codec may import its engine
        self._blob: bytes | None = None
        self._workers: list[Worker] = []  # every live worker, idle or busy
        self._idle: list[Worker] = []
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)  # notified when a worker joins _idle
        self._broken: str | None = None
        self._closed = False  # close(final=True): refuse compiles instead of starting workers again
        self._booting = 0  # workers being spawned, not yet in _workers
        self._spawn_error: str | None = None  # why the last spawn failed (cleared by a successful one)
        self._spawn_failed_at = 0.0  # monotonic time of that failure
        self._generation = 0  # bumped by close(): a worker that finishes booting after it is stopped
        self._started = self._killed = self._crashed = 0
        # Workers are forked from a zygote where the platform can (Linux); a zygote that fails turns that off.
        self._source = WorkerSource(memory_limit_mb, start_timeout_s, fork=fork_workers)
        self._finalizer = weakref.finalize(self, stop_all, self._workers, self._source.zygotes)

    def handles(self, impl: SamplerBackend) -> bool:
        described = self._descriptors.get(impl.name)
        return self._broken is None and described is not None and described.makes(impl)

    def start(self) -> None:
        """Boot the workers now (e.g. at server warm-up) instead of on the first compile; returns at once."""
        with self._lock:
            if self._closed or self._backing_off():
                return
            missing = self.size - len(self._workers) - self._booting
            self._booting += missing
        for _ in range(missing):
            _in_background(self._spawn)

    def wait_ready(self, count: int | None = None) -> None:
        """Start the workers and block until `count` of them (default: all) have built their tables."""
        self.start()
        taken: list[Worker] = []
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
            self._closed = self._source.closed = self._closed or final
            self._generation += 1
            stop_all(self._workers)
            self._idle.clear()
            zygotes = self._source.detach_zygotes()
            self._freed.notify_all()  # waiters for a worker see the close at once
        for zygote in zygotes:
            zygote.stop()

    @property
    def zygote_pid(self) -> int | None:
        """The process new workers are forked from, once booted."""
        return self._source.zygote_pid

    @property
    def forking(self) -> bool:
        """Whether new workers come from the zygote (else each is spawned and builds its own tables)."""
        return self._source.forking

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
        codec = self._codec(impl.name)
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
                        reply = (DIED,)
            if reply is None:
                self._replace(worker, killed=True)
                done = True
                raise CompileTimeout(
                    f"compiling took longer than the {budget.total:g} s deadline; {impl.name} was stopped",
                    backend=impl.name,
                    deadline_s=budget.total,
                )
            if reply[0] in FAILURES:
                self._replace(worker, killed=False)
                done = True
                # Killed by close(final=True) rather than by the grammar: stopped.
                _raise_failure(impl.name, reply, worker.exitcode, self.memory_limit_mb, stopped=self._closed)
            self._release(worker)
            done = True
            if reply[0] == REFUSED:
                raise CompileError(reply[1], backend=impl.name, unsupported=bool(reply[2]))
            with budget.charging():
                return codec.restore(impl, spec, reply[1])
        finally:
            if not done:  # an unexpected error between acquire and release: do not lose the slot
                self._replace(worker, killed=True)

    def _codec(self, name: str) -> Codec:
        with self._lock:
            codec = self._codecs.get(name)
            if codec is None:
                make = self._descriptors[name].codec
                assert make is not None  # sandboxable() keeps only backends with a codec
                codec = self._codecs[name] = make()
            return codec

    def _ready_worker(self, name: str) -> Worker:
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

    def _acquire(self) -> Worker | None:
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

    def _release(self, worker: Worker) -> None:
        with self._freed:
            if worker in self._workers:  # not stopped by close() meanwhile
                self._idle.append(worker)
                self._freed.notify()

    def _spawn(self) -> None:
        # Process.start() blocks until the child has read its arguments, i.e. until it has imported
        # its module (torch included, ~2 s): callers that must not wait run this on a thread.
        try:
            with self._lock:
                if self._blob is None:
                    self._blob = pickle.dumps((self.tokenizer, self._descriptors))
                blob, index, generation = self._blob, self._started, self._generation
                self._started += 1
            worker = self._source.new_worker(blob, index)
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

    def _replace(self, worker: Worker, *, killed: bool, respawn: bool = True) -> None:
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
        _in_background(self._spawn)


def _in_background(spawn: Callable[[], None]) -> None:
    # Not a daemon thread: interpreter exit waits for the spawn to finish (~2 s) rather than cut the
    # child's start-up data short; multiprocessing's exit hook then terminates the child.
    threading.Thread(target=spawn, name="corral-compile-spawn").start()


def _raise_failure(
    name: str, reply: Reply, exitcode: int | None, memory_limit_mb: int | None, *, stopped: bool
) -> NoReturn:
    """The error a compile worker's failure reply ends the compile with."""
    if stopped:
        raise CompileStopped(STOPPED, backend=name)
    if reply[0] == OOM:
        message = f"{name} needed more than {memory_limit_mb} MB to compile this grammar"
        raise CompileOutOfMemory(message, backend=name, limit_mb=memory_limit_mb)
    if reply[0] == DIED:
        raise CompileError(f"{name} crashed compiling this grammar (worker exit code {exitcode})", backend=name)
    raise CompileError(f"{name} failed on this grammar: {reply[1]}", backend=name)
