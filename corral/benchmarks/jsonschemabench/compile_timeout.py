"""Compile one schema with one backend (or `auto`) under a deadline, up to its first mask.

A hung native compile cannot be interrupted, so it runs in a daemon thread that is abandoned on
timeout: the benchmark records "timeout" and moves on instead of blocking forever."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from corral.grammar_engines.compilation import GrammarCache, GrammarRejected
from corral.grammar_engines.protocol import CompiledGrammar, SamplerBackend, allocate_bitmask
from corral.grammar_engines.registry import BackendSet
from corral.grammars.spec import GrammarSpec


class CompileStatus(StrEnum):
    OK = "ok"
    REJECTED = "rejected"  # every tried backend refused the schema
    TIMEOUT = "timeout"
    ERROR = "error"  # a backend raised something other than a refusal (a crash is a finding too)


@dataclass(frozen=True)
class CompileOutcome:
    status: CompileStatus
    backend: str | None = None  # the backend that compiled it (what `auto` routed to)
    compiled: CompiledGrammar | None = None
    impl: SamplerBackend | None = None
    compile_ms: float | None = None
    first_mask_ms: float | None = None  # llguidance compiles lazily: its real cost shows up here
    error: str | None = None
    tried: list[str] = field(default_factory=list)

    @property
    def declared(self) -> bool:
        return self.status is CompileStatus.OK

    @property
    def gct_ms(self) -> float | None:
        """Grammar compile time as JSONSchemaBench means it: until the first mask is ready."""
        if self.compile_ms is None or self.first_mask_ms is None:
            return None
        return self.compile_ms + self.first_mask_ms


def _compile_to_first_mask(
    backends: BackendSet, spec: GrammarSpec, backend: str, vocab_size: int, timeout_s: float, isolate: bool = False
) -> CompileOutcome:
    # A fresh single-entry cache per call: `auto` routing and fallback as the server does it, but never a
    # cache hit from an identical schema elsewhere in the data set (that would hide the compile cost).
    # isolate: compile in the server's killable worker processes (shared by every call on `backends`).
    cache = GrammarCache(backends, capacity=1, compile_timeout_s=timeout_s, isolate=isolate)
    start = time.perf_counter()
    try:
        result = cache.compile(spec, backend)
    except GrammarRejected as exc:
        status = CompileStatus.TIMEOUT if exc.timed_out else CompileStatus.REJECTED
        return CompileOutcome(status, error=str(exc), tried=list(exc.tried))
    compiled_at = time.perf_counter()
    impl = backends.for_request(result.backend, backend)  # `auto` serves through the contract guard
    matcher = impl.new_matcher(result.compiled)
    matcher.fill_bitmask(allocate_bitmask(1, vocab_size), 0)
    done = time.perf_counter()
    if matcher.error is not None:
        return CompileOutcome(CompileStatus.REJECTED, result.backend, error=f"first mask failed: {matcher.error}",
                              tried=[result.backend])
    return CompileOutcome(CompileStatus.OK, result.backend, result.compiled, impl,
                          (compiled_at - start) * 1000, (done - compiled_at) * 1000)


def compile_with_timeout(
    backends: BackendSet, spec: GrammarSpec, backend: str, vocab_size: int, timeout_s: float,
    drain_s: float = 120.0, isolate: bool = False,
) -> CompileOutcome:
    if isolate:
        # The worker is killed at the deadline, so nothing is left running to drain.
        try:
            return _compile_to_first_mask(backends, spec, backend, vocab_size, timeout_s, isolate=True)
        except Exception as exc:  # report a backend crash as a value; the benchmark goes on
            return CompileOutcome(CompileStatus.ERROR, error=f"{type(exc).__name__}: {exc}")
    box: list[CompileOutcome] = []
    finished = threading.Event()

    def work() -> None:
        try:
            box.append(_compile_to_first_mask(backends, spec, backend, vocab_size, timeout_s))
        except Exception as exc:  # report a backend crash as a value; the benchmark goes on
            box.append(CompileOutcome(CompileStatus.ERROR, error=f"{type(exc).__name__}: {exc}"))
        finally:
            finished.set()

    thread = threading.Thread(target=work, name=f"compile-{backend}", daemon=True)
    thread.start()
    if not finished.wait(timeout_s) or not box:
        # The abandoned compile keeps a core busy; let it drain (bounded) so it does not slow the next
        # schemas' measurements into timeouts of their own.
        thread.join(drain_s)
        return CompileOutcome(CompileStatus.TIMEOUT, error=f"no first mask within {timeout_s:g} s")
    return box[0]


def as_record(outcome: CompileOutcome) -> dict[str, Any]:
    return {
        "status": str(outcome.status),
        "routed": outcome.backend,
        "decode_safe": bool(outcome.compiled is not None and outcome.compiled.spec.decode_safe),
        "compile_ms": _round(outcome.compile_ms),
        "first_mask_ms": _round(outcome.first_mask_ms),
        "gct_ms": _round(outcome.gct_ms),
        "error": outcome.error[:500] if outcome.error else None,
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)
