"""What runs inside the compile zygote and the compile workers (the server's side is
corral/grammar_engines/worker_handles.py).

Both are spawned, never forked from the server (a threaded process can deadlock a forked child on a lock
another thread held); only the zygote, which runs nothing but idle library threads, forks. Both get the
tokenizer and the backends' descriptors pickled (`blob`), build every backend's tables once, cap their own
address space (RLIMIT_AS, `memory_limit_mb` above what they hold once ready) so a compile that explodes
in memory fails in the worker instead of waking the OOM killer on the host, and exit when their parent
disappears."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import os
import pickle
import resource
import signal
import threading
import time
from multiprocessing import reduction
from multiprocessing.connection import Connection

from corral.grammar_engines.pipe_protocol import FORKED, failed, ready, serve_compiles
from corral.grammar_engines.protocol import BackendDescriptor, Codec, SamplerBackend, TokenizerSpec
from corral.grammars.spec import GrammarKind, GrammarSpec

# Compiled in a forked child before the zygote says it is ready: forking must give a working worker.
FORK_PROBES = (GrammarSpec(GrammarKind.REGEX, "[a-z]{1,4}"), GrammarSpec(GrammarKind.JSON_SCHEMA, '{"type":"object"}'))
FORK_PROBE_TIMEOUT_S = 60.0
# What unpickling a blob and building the built-in backends import (~2 s): a zygote started ahead of its blob
# imports them while the server loads its model.
AHEAD_IMPORTS = ("transformers", "corral.grammar_engines.xgrammar_backend", "corral.grammar_engines.llguidance_backend")

Backends = dict[str, SamplerBackend]


def boot(blob: bytes) -> tuple[Backends, dict[str, Codec], dict[str, BackendDescriptor]]:
    """Every backend in `blob` built over its tokenizer, with a codec each."""
    tokenizer: TokenizerSpec
    descriptors: dict[str, BackendDescriptor]
    tokenizer, descriptors = pickle.loads(blob)
    backends = {name: d.factory(tokenizer) for name, d in descriptors.items()}
    for backend in backends.values():  # workers only compile: what matchers need goes (a backend may offer it)
        release = getattr(backend, "compile_only", None)
        if callable(release):
            release()
    codecs = {name: d.codec() for name, d in descriptors.items() if d.codec is not None}
    return backends, codecs, descriptors


def worker_main(conn: Connection, blob: bytes, memory_limit_mb: int | None) -> None:
    """A spawned worker: build the tables, then compile on request."""
    booted = time.monotonic()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the server; it stops us
    exit_with_parent(os.getppid())
    try:
        backends, codecs, _ = boot(blob)
    except BaseException as exc:
        conn.send(failed(exc))
        return
    limit_memory(memory_limit_mb)
    conn.send(ready(time.monotonic() - booted))
    serve_compiles(conn, backends, codecs)


def zygote_main(conn: Connection, blob: bytes | None, memory_limit_mb: int | None) -> None:
    """Build the backends' tables once, then fork ready workers from them on request (~0.1 s each instead
    of a ~5-8 s boot per worker). Every worker a compile bomb's deadline kills is replaced this way, so
    refusing a flood of bombs costs their deadlines, not a table build each. The zygote never compiles
    itself; it is single-threaded apart from idle library threads, and it proves a forked child can
    compile (`FORK_PROBES`) before it reports ready, else the pool spawns workers as before.
    `blob` None: started before the server had its tokenizer (`worker_handles.prespawn_zygote`); it imports
    ahead, then reads the blob from the pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent(os.getppid())
    if blob is None:
        for name in AHEAD_IMPORTS:
            with contextlib.suppress(ImportError):
                importlib.import_module(name)
        try:
            blob = conn.recv_bytes()
        except (EOFError, OSError):
            return  # the server never needed it
    booted = time.monotonic()
    try:
        backends, codecs, descriptors = boot(blob)
        blob = None
        settle_memory()
        probe_fork(backends, descriptors)
    except BaseException as exc:
        conn.send(failed(exc))
        return
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the workers (they are not the server's)
    conn.send(ready(time.monotonic() - booted))
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
                exit_with_parent(os.getppid())
                limit_memory(memory_limit_mb)
                worker_conn.send(ready(0.0))
                serve_compiles(worker_conn, backends, codecs)
            finally:
                os._exit(0)
        os.close(fd)
        conn.send((FORKED, pid))


def settle_memory() -> None:
    """Before the zygote forks: free what building the tables left (the pickled tokenizer, once the backends hold
    their own tables; glibc keeps freed memory unless asked), and move every surviving object out of the
    collector's reach (`gc.freeze`), so a forked worker's collections never write to — and so copy — the pages it
    shares with the zygote. On Gemma 3's 262,144-token vocabulary the zygote and its three workers took 0.59 GB
    (PSS) with this against 0.88 without (the tokenizer alone is ~0.3 GB)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    gc.freeze()


def probe_fork(backends: Backends, descriptors: dict[str, BackendDescriptor]) -> None:
    """Raise unless a child forked now compiles, with every backend, each probe of a kind it takes,
    within the timeout."""
    pid = os.fork()
    if pid == 0:
        try:
            for name, backend in backends.items():
                for spec in FORK_PROBES:
                    if spec.kind in descriptors[name].traits.kinds:
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


def exit_with_parent(parent: int) -> None:
    """A SIGKILLed server leaves no orphan burning a core on a hostile compile."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="corral-parent-watch", daemon=True).start()


def limit_memory(limit_mb: int | None) -> None:
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
