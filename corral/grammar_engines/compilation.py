"""Compile a spec with one backend or with `auto` routing, behind a cache keyed by the canonical spec.

Every compile runs under a deadline (`compile_timeout_s`) for every grammar kind. Backends with a codec (the
built-ins) compile in killable worker processes (corral.grammar_engines.sandbox): an overrun kills the worker, so a
hostile
grammar stops costing CPU at the deadline, and the refusal is cached like any other, so the same spec
is refused at once next time.

Under `auto` the deadline covers the whole attempt: a backend that refuses quickly leaves the rest of
the budget to the next one, while a backend that times out has spent it all, so `auto` stops there and
the caller hears about the timeout within one deadline (not one per backend).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field

from corral.grammar_engines.protocol import CompiledGrammar, CompileError, SamplerBackend
from corral.grammar_engines.registry import AUTO, BackendSet
from corral.grammar_engines.sandbox import (
    DEFAULT_MEMORY_LIMIT_MB,
    DEFAULT_WORKERS,
    Budget,
    CompileOutOfMemory,
    CompileSandbox,
    CompileStopped,
    CompileTimeout,
    SandboxUnavailable,
    sandboxable,
)
from corral.grammars.features import attempts
from corral.grammars.lowering import describe
from corral.grammars.spec import GrammarKind, GrammarSpec
from corral.grammars.validation import check_regex_hint

log = logging.getLogger(__name__)


class GrammarRejected(ValueError):
    """No backend could compile the spec. The message says what is wrong and which backends tried."""

    def __init__(
        self,
        message: str,
        *,
        tried: list[str],
        unsupported: bool,
        timed_out: bool = False,
        deadline_s: float | None = None,
        out_of_memory: bool = False,
    ) -> None:
        super().__init__(message)
        self.tried = tried
        self.unsupported = unsupported
        # True when compiling overran the deadline (`deadline_s`): the server answers
        # `grammar_compile_timeout` rather than `invalid_grammar`.
        self.timed_out = timed_out
        self.deadline_s = deadline_s
        # True when compiling needed more than a compile worker may use: `compile_out_of_memory`.
        self.out_of_memory = out_of_memory

    @property
    def retryable(self) -> bool:
        """A refusal that a less loaded host might not repeat; cached only for `timeout_retry_s`."""
        return self.timed_out or self.out_of_memory


@dataclass(frozen=True)
class CompileResult:
    compiled: CompiledGrammar
    backend: str
    cache_hit: bool
    compile_ms: float
    tried: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class CompileOptions:
    """How the server compiles (the `compile` settings group, handed over whole): the deadline, killable worker
    processes and their memory cap, and how long a cached timeout stands."""

    compile_timeout_s: float = 10.0
    compile_workers: int = DEFAULT_WORKERS
    compile_isolate: bool = True
    compile_memory_limit_mb: int | None = DEFAULT_MEMORY_LIMIT_MB
    compile_timeout_retry_s: float | None = 600.0


class GrammarCache:
    """Thread-safe LRU of compiled grammars and of refusals; concurrent misses on a key compile once.

    `isolate` runs the backends that have a codec (the built-ins) in killable worker processes (the server
    turns it on; the library default is in-process, with the deadline checked after the fact); the workers
    are shared by every cache over the same BackendSet, so short-lived caches cost no new processes.
    `timeout_retry_s`: a cached timeout expires after this long (None: never), so a grammar that only timed
    out because the host was overloaded is not refused forever.
    """

    def __init__(
        self,
        backends: BackendSet,
        capacity: int = 512,
        compile_timeout_s: float = 10.0,
        *,
        isolate: bool = False,
        sandbox: CompileSandbox | None = None,
        workers: int = DEFAULT_WORKERS,
        spare_workers: int = 1,
        memory_limit_mb: int | None = DEFAULT_MEMORY_LIMIT_MB,
        timeout_retry_s: float | None = 600.0,
    ) -> None:
        if compile_timeout_s <= 0:
            raise ValueError("compile_timeout_s must be positive")
        self.backends = backends
        self.capacity = capacity
        self.compile_timeout_s = compile_timeout_s
        self.timeout_retry_s = timeout_retry_s
        if sandbox is None and isolate and sandboxable(backends.enabled):
            sandbox = shared_sandbox(
                backends, workers=workers, spares=spare_workers, memory_limit_mb=memory_limit_mb
            )
        self.sandbox = sandbox
        self._entries: OrderedDict[tuple[str, str], CompiledGrammar | GrammarRejected] = OrderedDict()
        self._expiry: dict[tuple[str, str], float] = {}  # monotonic time after which a cached timeout is retried
        self._pending: dict[tuple[str, str], Future[CompiledGrammar | GrammarRejected]] = {}
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @classmethod
    def from_options(cls, backends: BackendSet, options: CompileOptions) -> GrammarCache:
        return cls(
            backends,
            compile_timeout_s=options.compile_timeout_s,
            isolate=options.compile_isolate,
            workers=options.compile_workers,
            memory_limit_mb=options.compile_memory_limit_mb,
            timeout_retry_s=options.compile_timeout_retry_s,
        )

    def warm_up(self) -> None:
        """Build every backend's tables, in this process and in the compile workers (which boot
        meanwhile), and return once all are ready. Replaces `backends.warm_up()` at server start."""
        if self.sandbox is not None:
            self.sandbox.start()
        self.backends.warm_up()
        if self.sandbox is not None:
            try:
                self.sandbox.wait_ready()
            except SandboxUnavailable as exc:  # serve anyway; compiles fall back to in-process
                log.error("compile workers are not available at start: %s", exc)

    def close(self, *, final: bool = False) -> None:
        """Stop the compile workers. A later compile starts fresh ones, unless `final` (the server is
        stopping): then compiles in flight and later ones are refused at once."""
        if self.sandbox is not None:
            self.sandbox.close(final=final)

    def lookup(self, spec: GrammarSpec, backend: str = AUTO) -> CompileResult | None:
        """Non-blocking: the cached outcome (a cached refusal raises, as from `compile`), or None when only
        `compile` can tell. Lets a caller answer cache hits without queueing behind compiles in progress."""
        self.backends.check_name(backend)
        key = (backend, spec.key)
        with self._lock:
            cached = self._entries.get(key)
            if cached is None or self._expiry.get(key, float("inf")) < time.monotonic():
                return None
            self._entries.move_to_end(key)
            self.hits += 1
        if isinstance(cached, GrammarRejected):
            raise cached
        return CompileResult(cached, cached.backend_name, True, 0.0)

    def compile(self, spec: GrammarSpec, backend: str = AUTO) -> CompileResult:
        """Blocking; call from a worker thread. Raises GrammarRejected."""
        self.backends.check_name(backend)
        start = time.perf_counter()
        key = (backend, spec.key)
        owner = False
        future: Future[CompiledGrammar | GrammarRejected] | None = None
        with self._lock:
            cached = self._entries.get(key)
            if cached is not None and self._expiry.get(key, float("inf")) < time.monotonic():
                self._forget(key)
                cached = None
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
                    self._store(key, cached)
                    if isinstance(cached, GrammarRejected) and cached.timed_out and backend == AUTO:
                        # The backend that timed out would time out on an explicit request too (unless
                        # it was compiling the decode-safe profile, which a named backend never does).
                        alone = (cached.tried[-1], spec.key)
                        named = alone[0] in self.backends.enabled
                        if named and alone not in self._entries and alone not in self._pending:
                            self._store(alone, cached)
                    del self._pending[key]
                future.set_result(cached)
            else:
                cached = future.result()
        if isinstance(cached, GrammarRejected):
            raise cached
        elapsed = (time.perf_counter() - start) * 1000
        return CompileResult(cached, cached.backend_name, not owner, elapsed)

    def _store(self, key: tuple[str, str], value: CompiledGrammar | GrammarRejected) -> None:
        self._entries[key] = value
        self._entries.move_to_end(key)
        if isinstance(value, GrammarRejected) and value.retryable and self.timeout_retry_s is not None:
            self._expiry[key] = time.monotonic() + self.timeout_retry_s
        while len(self._entries) > self.capacity:
            self._forget(next(iter(self._entries)))

    def _forget(self, key: tuple[str, str]) -> None:
        self._entries.pop(key, None)
        self._expiry.pop(key, None)

    def _compile_uncached(self, spec: GrammarSpec, backend: str) -> CompiledGrammar | GrammarRejected:
        plan = attempts(spec, self.backends.enabled, self.backends.traits) if backend == AUTO else [(backend, spec)]
        failures: list[CompileError] = []
        budget = Budget(self.compile_timeout_s)
        for name, variant in plan:
            impl = self.backends.get(name)
            label = f"{name} (decode-safe)" if variant.decode_safe else name
            reason = impl.supports(variant)
            if reason is not None:
                failures.append(CompileError(reason, backend=label, unsupported=True))
                continue
            try:
                t0 = time.perf_counter()
                compiled = self._compile_one(impl, variant, budget)
                log.debug("compiled %s with %s in %.1f ms", variant.key, label, (time.perf_counter() - t0) * 1000)
                return compiled
            except CompileStopped as exc:
                failures.append(exc)
                break  # shutting down: no further attempt either
            except CompileTimeout as exc:
                log.warning("compiling %s with %s overran the %g s deadline", variant.key, label, exc.deadline_s)
                exc.backend = label
                failures.append(exc)
                break  # the budget is spent; see the module docstring
            except CompileError as exc:
                log.info("backend %s refused %s: %s", label, variant.key, exc)
                exc.backend = label
                failures.append(exc)
        return _rejection(spec, failures)

    def _compile_one(self, impl: SamplerBackend, spec: GrammarSpec, budget: Budget) -> CompiledGrammar:
        if self.sandbox is not None and self.sandbox.handles(impl):
            try:
                return self.sandbox.compile(impl, spec, budget)
            except SandboxUnavailable:
                pass  # logged by the sandbox; compile in-process below
        if budget.remaining <= 0:
            raise CompileTimeout(
                f"no time left of the {budget.total:g} s deadline", backend=impl.name, deadline_s=budget.total
            )
        # In-process (plug-ins, or isolate=False): the deadline is checked after the fact; this thread
        # cannot be stopped, so a slow compile still finishes (and is cached as a timeout).
        with budget.charging():
            compiled = impl.compile(spec)
        if budget.remaining < 0:
            raise CompileTimeout(
                f"compiling took longer than the {budget.total:g} s deadline",
                backend=impl.name,
                deadline_s=budget.total,
            )
        return compiled


_shared: weakref.WeakKeyDictionary[BackendSet, CompileSandbox] = weakref.WeakKeyDictionary()
_shared_lock = threading.Lock()


def shared_sandbox(
    backends: BackendSet,
    *,
    workers: int = DEFAULT_WORKERS,
    spares: int = 1,
    memory_limit_mb: int | None = DEFAULT_MEMORY_LIMIT_MB,
) -> CompileSandbox:
    """The compile workers for `backends`, created on first use (the first caller's settings win): `workers`
    compile at once, and `spares` more stand ready so a killed worker's reboot holds no compile up."""
    with _shared_lock:
        sandbox = _shared.get(backends)
        if sandbox is None:
            sandbox = CompileSandbox(
                backends.tokenizer, backends.enabled, workers=workers, spares=spares, memory_limit_mb=memory_limit_mb
            )
            _shared[backends] = sandbox
        return sandbox


def _rejection(spec: GrammarSpec, failures: list[CompileError]) -> GrammarRejected:
    tried = [f.backend for f in failures]
    details = "; ".join(f"{f.backend}: {f}" for f in failures)
    last = failures[-1] if failures else None
    if isinstance(last, CompileTimeout):
        message = (
            f"compiling the {describe(spec)} took longer than the {last.deadline_s:g} s deadline "
            f"({details}); simplify it"
        )
        return GrammarRejected(message, tried=tried, unsupported=False, timed_out=True, deadline_s=last.deadline_s)
    if isinstance(last, CompileOutOfMemory):
        message = f"compiling the {describe(spec)} needed more memory than a compile worker may use ({details})"
        return GrammarRejected(message, tried=tried, unsupported=False, out_of_memory=True)
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
