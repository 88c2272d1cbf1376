"""The serving core's compile stage: a request's constraint compiled on the compile threads under the deadline,
a cache hit answered at once, every failure a 400 naming the field."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable

from corral.grammar_engines.compilation import CompileResult, GrammarCache, GrammarRejected
from corral.grammar_engines.registry import BackendSet, UnknownBackend
from corral.grammars.request import ConstraintRequest
from corral.server.errors import ApiError, bad_request
from corral.server.metrics import Metrics
from corral.server.torch_threads import helper_pool
from corral.structured import Trip


class CompileStage:
    def __init__(
        self, grammars: GrammarCache, backends: BackendSet, metrics: Metrics, *, workers: int, timeout_s: float
    ) -> None:
        self.grammars = grammars
        self.backends = backends
        self.metrics = metrics
        self.timeout_s = timeout_s
        self._pool = helper_pool(workers, "corral-compile")
        # How long a request may wait for a compile thread to take its compile (see `_in_pool`).
        self.queue_wait_s = 2 * timeout_s + 30

    def check_backend(self, constraint: ConstraintRequest) -> None:
        try:
            self.backends.check_name(constraint.backend)
        except UnknownBackend as exc:
            raise bad_request(str(exc), param=constraint.backend_source) from exc

    async def compile(self, constraint: ConstraintRequest) -> CompileResult:
        """Compile on the compile threads under the deadline; a cache hit answers at once. Failures are 400s."""
        assert constraint.spec is not None
        loop = asyncio.get_running_loop()
        started = asyncio.Event()
        spec, backend = constraint.spec, constraint.backend

        def work() -> CompileResult:
            loop.call_soon_threadsafe(started.set)
            return self.grammars.compile(spec, backend)

        deadline = self.timeout_s
        try:
            # A cache hit is answered here: compile bombs can hold every compile thread for the deadline.
            hit = self.grammars.lookup(spec, backend)
            result = hit if hit is not None else await self._in_pool(work, started, deadline)
        except TimeoutError as exc:
            self.metrics.trips.labels(str(Trip.COMPILE_TIMEOUT)).inc()
            raise bad_request(
                f"compiling the {constraint.spec.kind} constraint took longer than {deadline:g} s; simplify it",
                param=constraint.source,
                code="grammar_compile_timeout",
            ) from exc
        except GrammarRejected as exc:
            if exc.timed_out:
                self.metrics.trips.labels(str(Trip.COMPILE_TIMEOUT)).inc()
                code = "grammar_compile_timeout"
            elif exc.out_of_memory:
                code = "compile_out_of_memory"
            else:
                code = "unsupported_schema" if exc.unsupported else "invalid_grammar"
            raise bad_request(str(exc), param=constraint.source, code=code) from exc
        self.metrics.cache.labels("hit" if result.cache_hit else "miss").inc()
        if not result.cache_hit:
            self.metrics.compile.labels(result.backend).observe(result.compile_ms / 1000)
        return result

    async def _in_pool(
        self, work: Callable[[], CompileResult], started: asyncio.Event, deadline: float
    ) -> CompileResult:
        loop = asyncio.get_running_loop()
        # In the request's context, so the compile's log lines carry its request id (corral/server/request_context.py).
        future = loop.run_in_executor(self._pool, contextvars.copy_context().run, work)
        # The shield outlives a cancelled request (client gone, shutdown): collect its outcome so asyncio
        # does not report it as never retrieved; the result is cached by GrammarCache anyway.
        future.add_done_callback(lambda done: done.cancelled() or done.exception())
        try:
            # Every compile ahead in the queue ends within its own deadline, so a wait this long means the
            # compile threads are stuck or flooded: answer now rather than hold the request forever.
            await asyncio.wait_for(started.wait(), timeout=self.queue_wait_s)
        except TimeoutError as exc:
            future.cancel()  # not started: it never will
            raise ApiError(
                503,
                f"no compile thread came free within {self.queue_wait_s:g} s; retry shortly",
                type_="service_unavailable",
                code="compile_queue_full",
            ) from exc
        # GrammarCache enforces the deadline itself (killing the compile worker); a success may take up
        # to ~2x it (the parent rebuilds what the worker proved bounded). This wait is only a safety net.
        return await asyncio.wait_for(asyncio.shield(future), timeout=2 * deadline + 30)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.grammars.close(final=True)
