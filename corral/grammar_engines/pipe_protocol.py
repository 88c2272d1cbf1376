"""The messages on the pipes between the server, the compile zygote and the compile workers.

Every message is a pickled tuple whose first item is its tag; `None` asks the other end to stop.
- a starting zygote or worker:  ("ready", pid, seconds it took) | ("failed", why)
- server -> zygote:              ("fork",) followed by the worker's pipe end (multiprocessing.reduction)
- zygote -> server:              ("forked", pid)
- server -> worker:              (backend name, GrammarSpec)
- worker -> server:              ("ok", codec payload) | ("refused", message, unsupported)
                                 | ("oom",) | ("crashed", text)
The parent adds ("died",) for a worker whose pipe broke mid-compile."""

from __future__ import annotations

import os
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from corral.grammar_engines.protocol import Codec, CompileError, SamplerBackend
from corral.grammar_engines.sandbox_errors import SandboxUnavailable
from corral.grammars.spec import GrammarSpec

READY, FAILED, FORK, FORKED = "ready", "failed", "fork", "forked"
OK, REFUSED, OOM, CRASHED, DIED = "ok", "refused", "oom", "crashed", "died"
FAILURES = (OOM, CRASHED, DIED)  # the worker is gone or unusable: it is replaced

Job = tuple[str, GrammarSpec]
Reply = tuple[Any, ...]


def ready(seconds: float) -> Reply:
    return (READY, os.getpid(), seconds)


def failed(exc: BaseException) -> Reply:
    return (FAILED, f"{type(exc).__name__}: {exc}")


def compile_reply(backend: SamplerBackend, codec: Codec, spec: GrammarSpec) -> Reply:
    """In the worker: compile `spec` and say how it went. Out of memory has its own reply, however the
    engine reports it (xgrammar reports an allocation failure as a RuntimeError, turned CompileError)."""
    try:
        return (OK, codec.export(backend.compile(spec)))
    except CompileError as exc:
        return (OOM,) if "bad_alloc" in str(exc) else (REFUSED, str(exc), exc.unsupported)
    except MemoryError:
        return (OOM,)
    except Exception as exc:
        text = f"{type(exc).__name__}: {exc}"
        return (OOM,) if "bad_alloc" in text else (CRASHED, text)


def serve_compiles(conn: Connection, backends: dict[str, SamplerBackend], codecs: dict[str, Codec]) -> None:
    """The worker's loop: one job in, one reply out, until told to stop or the server is gone."""
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        name, spec = job
        reply = compile_reply(backends[name], codecs[name], spec)
        try:
            conn.send(reply)
        except MemoryError:
            conn.send((OOM,))


def await_ready(conn: Connection, what: str, timeout_s: float, exitcode: Callable[[], int | None]) -> Reply:
    """The ("ready", pid, seconds) message a starting process sends; SandboxUnavailable otherwise."""
    if not conn.poll(timeout_s):
        raise SandboxUnavailable(f"{what} did not start within {timeout_s:g} s")
    try:
        message: Reply = conn.recv()
    except (EOFError, OSError) as exc:
        raise SandboxUnavailable(f"{what} died while starting (exit code {exitcode()})") from exc
    if message[0] != READY:
        raise SandboxUnavailable(f"{what} failed to start: {message[1]}")
    return message
