"""Compile a spec with one backend or with `auto` routing, behind a cache keyed by the canonical spec."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field

from grammars.features import route
from grammars.lowering import describe
from grammars.spec import GrammarKind, GrammarSpec
from grammars.validation import check_regex_hint
from samplers.protocol import CompiledGrammar, CompileError
from samplers.registry import AUTO, BackendSet

log = logging.getLogger(__name__)


class GrammarRejected(ValueError):
    """No backend could compile the spec. The message says what is wrong and which backends tried."""

    def __init__(self, message: str, *, tried: list[str], unsupported: bool) -> None:
        super().__init__(message)
        self.tried = tried
        self.unsupported = unsupported


@dataclass(frozen=True)
class CompileResult:
    compiled: CompiledGrammar
    backend: str
    cache_hit: bool
    compile_ms: float
    tried: list[str] = field(default_factory=list)


class GrammarCache:
    """Thread-safe LRU of compiled grammars and of refusals; concurrent misses on a key compile once."""

    def __init__(self, backends: BackendSet, capacity: int = 512) -> None:
        self.backends = backends
        self.capacity = capacity
        self._entries: OrderedDict[tuple[str, str], CompiledGrammar | GrammarRejected] = OrderedDict()
        self._pending: dict[tuple[str, str], Future[CompiledGrammar | GrammarRejected]] = {}
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def compile(self, spec: GrammarSpec, backend: str = AUTO) -> CompileResult:
        """Blocking; call from a worker thread. Raises GrammarRejected."""
        self.backends.check_name(backend)
        start = time.perf_counter()
        key = (backend, spec.key)
        owner = False
        future: Future[CompiledGrammar | GrammarRejected] | None = None
        with self._lock:
            cached = self._entries.get(key)
            if cached is not None:
                self._entries.move_to_end(key)
                self.hits += 1
            else:
                future = self._pending.get(key)
                if future is None:
                    future = Future()
                    self._pending[key] = future
                    owner = True
                    self.misses += 1
        if cached is None:
            assert future is not None  # set above whenever there was no cached entry
            if owner:
                try:
                    cached = self._compile_uncached(spec, backend)
                except Exception as exc:  # an engine bug must not leave waiters on this key hanging
                    log.exception("backend crashed compiling %s", spec.key)
                    cached = GrammarRejected(
                        f"the grammar engine failed on this {describe(spec)}: {exc}", tried=[backend], unsupported=False
                    )
                with self._lock:
                    self._entries[key] = cached
                    while len(self._entries) > self.capacity:
                        self._entries.popitem(last=False)
                    del self._pending[key]
                future.set_result(cached)
            else:
                cached = future.result()
        if isinstance(cached, GrammarRejected):
            raise cached
        elapsed = (time.perf_counter() - start) * 1000
        return CompileResult(cached, cached.backend_name, not owner, elapsed)

    def _compile_uncached(self, spec: GrammarSpec, backend: str) -> CompiledGrammar | GrammarRejected:
        names = route(spec, self.backends.enabled) if backend == AUTO else [backend]
        failures: list[CompileError] = []
        for name in names:
            impl = self.backends.get(name)
            reason = impl.supports(spec)
            if reason is not None:
                failures.append(CompileError(reason, backend=name, unsupported=True))
                continue
            try:
                t0 = time.perf_counter()
                compiled = impl.compile(spec)
                log.debug("compiled %s with %s in %.1f ms", spec.key, name, (time.perf_counter() - t0) * 1000)
                return compiled
            except CompileError as exc:
                log.info("backend %s refused %s: %s", name, spec.key, exc)
                failures.append(exc)
        return _rejection(spec, failures)


def _rejection(spec: GrammarSpec, failures: list[CompileError]) -> GrammarRejected:
    tried = [f.backend for f in failures]
    details = "; ".join(f"{f.backend}: {f}" for f in failures)
    unsupported = all(f.unsupported for f in failures)
    if spec.is_json and unsupported:
        message = f"no backend can enforce this JSON Schema (tried {', '.join(tried)}) — {details}"
    else:
        message = f"invalid {describe(spec)} — {details}"
        if spec.kind is GrammarKind.REGEX:
            hint = check_regex_hint(spec.source)
            if hint:
                message += f" (Python's regex parser: {hint})"
    return GrammarRejected(message, tried=tried, unsupported=unsupported)
