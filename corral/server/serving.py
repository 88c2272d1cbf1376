"""The serving core between HTTP and the engine: prompt, constraint, compile, submit, collect, check."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import itertools
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from typing import Any, ParamSpec, TypeVar

from corral.grammar_engines.compilation import CompileOptions, CompileResult, GrammarCache
from corral.grammar_engines.protocol import TokenizerSpec
from corral.grammar_engines.registry import BackendSet
from corral.grammars.contract import has_tool_calls, validate_output
from corral.grammars.request import AUTO, ConstraintRequest
from corral.grammars.spec import GrammarSpec
from corral.grammars.validation import OutputCheck
from corral.server.answer_metrics import ERROR, count_answer
from corral.server.compile_stage import CompileStage
from corral.server.engine import Engine, EngineConfig, EngineLoop, SeqOutput, StepWatchdog
from corral.server.errors import ApiError, guard_stream
from corral.server.fallback import AutoFallback, engine_failed
from corral.server.memory import release_freed_memory
from corral.server.metrics import Metrics
from corral.server.models import LoadedModel
from corral.server.prepared import Admission, Finished, Prepared, json_styled, sequence_for
from corral.server.settings import Settings
from corral.server.torch_threads import helper_pool, single_torch_thread
from corral.structured import Trip, WatchdogLimits

log = logging.getLogger(__name__)

INVALID_OUTPUT = "invalid_output"
CLOSED = "closed"  # the engine closed a structured answer early (corral/structured/answer_closing.py)
# Threads for the request work whose cost grows with the request (chat-template rendering, tokenization,
# schema checks, output validation): bounded, so a flood of huge requests queues here rather than spawning
# threads, and one huge request leaves the others free.
PREPARE_THREADS = 4

P = ParamSpec("P")
T = TypeVar("T")


class Service:
    def __init__(self, settings: Settings, loaded: LoadedModel) -> None:
        self.settings = settings
        self.loaded = loaded
        if loaded.device.type == "cpu":
            single_torch_thread()  # torch runs wide on the engine thread only (corral/server/torch_threads.py)
        self.model_name = settings.served_model_name or loaded.name
        tokenizer = TokenizerSpec(loaded.tokenizer, loaded.vocab_size, loaded.stop_token_ids)
        self.backends = BackendSet(tokenizer, settings.backend_list())
        self.grammars = GrammarCache.from_options(self.backends, settings.group(CompileOptions))
        limits = settings.group(WatchdogLimits)
        choices = settings.cpu_thread_choices() if loaded.device.type == "cpu" else ()
        config = settings.group(
            EngineConfig, revision_token_id=loaded.revision_token_id, limits=limits, thread_choices=choices
        )
        self.engine = Engine(loaded, config)
        self.loop = EngineLoop(self.engine)
        self._prepare_pool = helper_pool(PREPARE_THREADS, "corral-prepare")
        self._ids = itertools.count()
        self.in_flight = 0
        self.ready = False
        self.metrics = Metrics()
        self.compiler = CompileStage(
            self.grammars, self.backends, self.metrics,
            workers=settings.compile_workers, timeout_s=settings.compile_timeout_s,
        )
        self.fallback = AutoFallback(self.compile, self.backends.enabled)
        self.engine.on_trip = lambda kind: self.metrics.trips.labels(kind).inc()
        self.engine.runner.prefix.on_lookup = self.metrics.prefix_lookup
        self.watchdog = StepWatchdog(
            self.engine,
            self.loop,
            settings.hung_step_timeout_s,
            exit_on_hang=settings.exit_on_hung_step,
            on_trip=lambda: self.metrics.trips.labels(str(Trip.HUNG_STEP)).inc(),
        )
        scheduler = self.engine.scheduler
        self.metrics.bind_gauges(lambda: len(scheduler.running), lambda: len(scheduler.waiting))
        store = self.engine.runner.prefix.store
        self.metrics.prefix_host_bytes.set_function(lambda: store.bytes if store is not None else 0)

    def start(self) -> None:
        # Tokenizer tables (parent and compile workers) are built once, at start, not on a first request.
        self.grammars.warm_up()
        release_freed_memory()  # the loads' parses (tokenizer, GGUF header, tables) are done with
        self.loop.start()
        self.watchdog.start()
        self.ready = True

    def stop(self) -> None:
        self.ready = False
        self.watchdog.stop()
        self.loop.stop()
        self._prepare_pool.shutdown(wait=False, cancel_futures=True)
        self.compiler.shutdown()

    async def off_loop(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run `fn` on the prepare threads: nothing whose cost grows with a request runs on the event loop,
        where it would hold up every other request (a 2 MB message tokenizes for seconds)."""
        call = functools.partial(fn, *args, **kwargs)
        # In the request's context, so log lines written there carry its request id.
        context = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(self._prepare_pool, context.run, call)

    # -- request preparation -----------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.loaded.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.loaded.vocab_size

    @property
    def max_len(self) -> int:
        """Tokens a request's prompt and answer may hold together."""
        return self.engine.max_len

    @property
    def healthy(self) -> bool:
        return self.ready and self.watchdog.healthy and self.loop.alive

    def backend_capabilities(self) -> tuple[list[str], str | None]:
        """The backends enabled, and how dispatch markers ride in a constraint (a Lark grammar with `%json`, if
        one of them takes it)."""
        enabled = list(self.backends.enabled)
        return enabled, "lark_json" if any(self.backends.traits(n).lark_json for n in enabled) else None

    def queue_depths(self) -> tuple[int, int]:
        """Requests running and waiting in the engine."""
        return len(self.engine.scheduler.running), len(self.engine.scheduler.waiting)

    def guarded(self, events: AsyncGenerator[str | dict[str, str], None]) -> AsyncIterator[str | dict[str, str]]:
        """A response stream whose unexpected failure ends it with an error event, counted."""
        return guard_stream(events, self.metrics.internal_errors)

    # -- request preparation -----------------------------------------------------------------------
    async def prepare(self, model: str | None, build: Callable[[], Admission], *, stream: bool = False) -> Prepared:
        """A request ready for `run` or `stream`: the server is up and serves `model`; `build` (the front end's
        reading of the request: prompt, constraint, sampling) runs on the prepare threads; the constraint is
        compiled (cached). A request to be streamed is refused here when the server is full, so its 429 comes
        before the stream's 200 headers."""
        received = time.perf_counter()
        if not self.ready or not self.watchdog.healthy:
            raise ApiError(503, "the server is starting or stopping; retry shortly", type_="service_unavailable")
        if model is not None and model not in (self.model_name, "default"):
            raise ApiError(
                404,
                f"model {model!r} is not served here; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )
        admission = await self.off_loop(build)
        params = admission.params
        constraint = json_styled(admission.constraint, params.json_leading_whitespace, self.settings,
                                 params.json_whitespace)
        if constraint.spec is not None:
            compiled: CompileResult | None = await self.compile(constraint)  # names a backend that exists, or 400s
        else:
            self.compiler.check_backend(constraint)
            compiled = None
        if stream:
            self.check_capacity()
        request_id = f"{next(self._ids)}-{uuid.uuid4().hex[:12]}"
        return Prepared(request_id, admission.prompt_ids, params, constraint, compiled, received)

    async def compile(self, constraint: ConstraintRequest) -> CompileResult:
        """The constraint compiled (cached) under the deadline, or a 400 (corral/server/compile_stage.py)."""
        self.compiler.check_backend(constraint)
        return await self.compiler.compile(constraint)

    # -- running -----------------------------------------------------------------------------------
    def check_capacity(self) -> None:
        """429 when the server holds its limit of requests. A streamed request asks before its 200 headers
        go out, so a client sees a real 429 rather than an error inside a stream that began well."""
        if self.in_flight >= self.settings.max_queue:
            self.metrics.rejected.labels("429").inc()
            raise ApiError(
                429,
                f"the server is at its limit of {self.settings.max_queue} requests; retry later",
                type_="rate_limit_error",
                code="queue_full",
            )

    async def stream(self, prepared: Prepared) -> AsyncGenerator[tuple[SeqOutput, Finished | None], None]:
        """The engine's outputs for a prepared request as they come, each with the finished answer (checked
        against the full contract) once it is the last; a cancelled consumer (disconnect) aborts."""
        async with aclosing(self._outputs(prepared, deltas=True)) as outputs:
            async for out in outputs:
                yield out, (await self.off_loop(self.finish, prepared, out) if out.finished else None)

    async def _outputs(self, prepared: Prepared, *, deltas: bool = True) -> AsyncGenerator[SeqOutput, None]:
        """Submit to the engine and yield its outputs; a cancelled consumer (disconnect) aborts. Under `auto`, an
        answer a grammar engine failed (`error`: its fill raised, or it refused a token its own mask allowed) is
        generated again with the next backend, as a compile refusal is, if nothing of it was sent yet (always so
        unstreamed; streamed, when it failed before its first text). `finish` reports the answer that ran."""
        sent = False
        failed: SeqOutput | None = None
        async with aclosing(self._stream_once(prepared, deltas)) as outputs:
            async for out in outputs:
                if out.finished and not sent and engine_failed(prepared, out):
                    failed = out
                    break
                sent = sent or bool(out.delta or out.logprobs)
                yield out
        if failed is None:
            return
        retry = await self.fallback.next_backend(prepared, f"ended by a grammar engine error ({failed.seq.error})")
        if retry is None or prepared.compiled is None:
            yield failed
            return
        await self.off_loop(self.finish, prepared, failed)  # counted as the failure it was
        async with aclosing(self._stream_once(retry, deltas)) as outputs:
            async for out in outputs:
                if out.finished:
                    self.fallback.reruns[out.seq] = (retry, prepared.compiled.backend)
                yield out

    async def _stream_once(self, prepared: Prepared, deltas: bool) -> AsyncGenerator[SeqOutput, None]:
        self.check_capacity()
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[SeqOutput] = asyncio.Queue()

        def sink(out: SeqOutput) -> None:  # engine thread → event loop
            if not loop.is_closed():  # a final answer given as the server stops may find no loop to take it
                loop.call_soon_threadsafe(outputs.put_nowait, out)

        compiled = prepared.compiled
        backend = self.backends.for_request(compiled.backend, prepared.constraint.backend) if compiled else None
        seq = sequence_for(prepared, backend, sink, streaming=deltas, close_answers=self.settings.close_answers)
        self.in_flight += 1
        finished = False
        try:
            self.loop.submit(seq)
            while True:
                out = await outputs.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self.in_flight -= 1
            if not finished:  # the consumer went away (client disconnect): free the slot now
                self.loop.abort(seq.request_id)
                self.metrics.requests.labels("abort").inc()

    async def run(self, prepared: Prepared) -> Finished:
        """Generate to the end. With `auto`, the contract guard keeps an answer from ending outside the
        full schema; when that leaves a dead end (or an answer still fails the check), it is generated
        once more with the next backend that compiles the spec, so one engine's enforcement gap does
        not reach the caller; what still fails keeps its finish_reason, never `stop`."""
        done = await self._run_once(prepared)
        retryable = done.finish_reason in (INVALID_OUTPUT, str(Trip.DEAD_END)) and done.fallback_from is None
        if retryable and prepared.constraint.backend == AUTO and prepared.compiled:
            retry = await self.fallback.next_backend(prepared, f"failed validation ({done.finish_reason})")
            if retry is not None:
                first_backend = prepared.compiled.backend
                done = await self._run_once(retry)
                done.fallback_from = first_backend
        return done

    async def _run_once(self, prepared: Prepared) -> Finished:
        async for out in self._outputs(prepared, deltas=False):
            if out.finished:
                return await self.off_loop(self.finish, prepared, out)  # validates the whole answer
        raise RuntimeError("engine stream ended without a final output")

    def finish(self, prepared: Prepared, out: SeqOutput) -> Finished:
        seq = out.seq
        prepared, fallback_from = self.fallback.reruns.get(seq, (prepared, None))
        spec = prepared.constraint.spec
        cause = seq.error if out.finish_reason == ERROR else None
        check = self.check_output(spec, seq.text, out.finish_reason, cause) if spec is not None else None
        reason = out.finish_reason or "stop"
        if reason in ("stop", CLOSED) and check is not None and not check.valid:
            reason = INVALID_OUTPUT  # the grammar finished but the full contract does not hold
        if reason == "stop" and has_tool_calls(check):
            reason = "tool_calls"
        done = Finished(seq.text, reason, seq, check, prepared, fallback_from)
        count_answer(self.metrics, seq, reason, check, spec)
        return done

    @staticmethod
    def check_output(spec: GrammarSpec, text: str, finish_reason: str | None, cause: str | None = None) -> OutputCheck:
        """The answer's full-contract check; one that did not finish fails it, naming `cause` if known."""
        if finish_reason not in ("stop", CLOSED):
            because = f": {cause}" if cause else ""
            return OutputCheck(False, f"generation ended by {finish_reason} before the grammar completed{because}")
        return validate_output(spec, text)
