"""The serving core between HTTP and the engine: prompt, constraint, compile, submit, collect, check."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, ParamSpec, TypeVar

import torch

from grammars.features import route
from grammars.request import AUTO, ConstraintRequest, parse_constraint
from grammars.spec import GrammarSpec
from grammars.validation import InvalidConstraint, OutputCheck, validate_output
from samplers.compilation import CompileResult, GrammarCache, GrammarRejected
from samplers.protocol import TokenizerSpec
from samplers.registry import BackendSet, UnknownBackend
from samplers.watchdog import Trip, WatchdogLimits
from server.engine import Engine, EngineConfig, EngineLoop, SamplingParams, SeqOutput, Sequence
from server.errors import ApiError, bad_request
from server.metrics import Metrics
from server.models import LoadedModel
from server.openai.chat_render import MessageError, prompt_ids
from server.openai.fields import max_tokens_for
from server.openai.logprobs import requested_logprobs
from server.openai.modes import request_mode
from server.openai.request_limits import input_limits
from server.openai.tools import detect_format, has_tool_calls, parse_tools, tool_constraint
from server.protocol import ChatCompletionRequest, CompletionRequest, _Request
from server.settings import Settings

log = logging.getLogger(__name__)

INVALID_OUTPUT = "invalid_output"
# Threads for the request work whose cost grows with the request (chat-template rendering, tokenization,
# schema checks, output validation): bounded, so a flood of huge requests queues here rather than spawning
# threads, and one huge request leaves the others free.
PREPARE_THREADS = 4

P = ParamSpec("P")
T = TypeVar("T")


@dataclass
class Prepared:
    """A validated request, ready for the engine."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    constraint: ConstraintRequest
    compiled: CompileResult | None
    received: float


@dataclass
class Finished:
    text: str
    finish_reason: str
    seq: Sequence
    check: OutputCheck | None
    prepared: Prepared
    fallback_from: str | None = None  # the backend whose answer failed post-validation (auto only)


class Service:
    def __init__(self, settings: Settings, loaded: LoadedModel) -> None:
        self.settings = settings
        self.loaded = loaded
        if loaded.device.type == "cpu":
            torch.set_num_threads(settings.cpu_threads())  # masks are filled on another thread meanwhile
        self.model_name = settings.served_model_name or loaded.name
        self.limits = input_limits(settings)  # request limits on constraints (grammars/limits.py)
        self.tool_format = detect_format(settings.tool_call_format, loaded.tokenizer)
        tokenizer = TokenizerSpec(loaded.tokenizer, loaded.vocab_size, loaded.stop_token_ids)
        self.backends = BackendSet(tokenizer, settings.backend_list())
        self.grammars = GrammarCache(
            self.backends,
            compile_timeout_s=settings.compile_timeout_s,
            isolate=settings.compile_isolate,
            workers=settings.compile_workers,
            memory_limit_mb=settings.compile_memory_limit_mb,
            timeout_retry_s=settings.compile_timeout_retry_s,
        )
        self.engine = Engine(
            loaded,
            EngineConfig(
                max_batch=settings.max_batch,
                max_model_len=settings.max_model_len,
                jump_forward=settings.jump_forward,
                revision_token_id=loaded.revision_token_id,
                max_revisions=settings.max_revisions,
                prefix_cache=settings.prefix_cache,
                limits=WatchdogLimits(
                    whitespace_run=settings.stall_whitespace_tokens,
                    repeat_window=settings.stall_repeat_tokens,
                    mask_budget_ms=settings.mask_budget_ms,
                    mask_overruns=settings.mask_overruns,
                ),
            ),
        )
        self.loop = EngineLoop(self.engine)
        self._compile_pool = ThreadPoolExecutor(settings.compile_workers, thread_name_prefix="corral-compile")
        self._prepare_pool = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="corral-prepare")
        # How long a request may wait for a compile thread to take its compile (see `_compile`).
        self.compile_queue_wait_s = 2 * settings.compile_timeout_s + 30
        self._ids = itertools.count()
        self.in_flight = 0
        self.ready = False
        self.metrics = Metrics()
        self.engine.on_trip = lambda kind: self.metrics.trips.labels(kind).inc()
        self.engine.runner.prefix.on_lookup = self.metrics.prefix_lookup
        self.healthy = True
        self.exit_process: Callable[[int], None] = os._exit  # replaced in tests
        self._watchdog = threading.Thread(target=self._watch_steps, name="corral-step-watchdog", daemon=True)
        self._stopping = threading.Event()
        scheduler = self.engine.scheduler
        self.metrics.bind_gauges(lambda: len(scheduler.running), lambda: len(scheduler.waiting))

    def start(self) -> None:
        # Tokenizer tables (parent and compile workers) are built once, at start, not on a first request.
        self.grammars.warm_up()
        self.loop.start()
        self._watchdog.start()
        self.ready = True

    def stop(self) -> None:
        self.ready = False
        self._stopping.set()
        self.loop.stop()
        self._compile_pool.shutdown(wait=False, cancel_futures=True)
        self._prepare_pool.shutdown(wait=False, cancel_futures=True)
        self.grammars.close(final=True)

    async def off_loop(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run `fn` on the prepare threads: nothing whose cost grows with a request runs on the event loop,
        where it would hold up every other request (a 2 MB message tokenizes for seconds)."""
        call = functools.partial(fn, *args, **kwargs)
        # In the request's context, so log lines written there carry its request id.
        context = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(self._prepare_pool, context.run, call)

    def _watch_steps(self) -> None:
        """Hung-step watchdog. A step that overruns its deadline cannot be interrupted (it is inside
        the model or an engine), so corral fails every in-flight request with an error response,
        reports unhealthy, and exits so a supervisor (docker `restart:`, systemd, k8s) restarts it."""
        deadline = self.settings.hung_step_timeout_s
        while not self._stopping.wait(min(0.25, deadline / 4)):
            started = self.loop.step_started
            if started is None or time.monotonic() - started <= deadline:
                continue
            log.error("engine step has run for more than %.1f s: failing in-flight requests", deadline)
            self.healthy = False
            self.metrics.trips.labels(str(Trip.HUNG_STEP)).inc()
            # This thread must not touch the scheduler the stuck step may still use: answer, don't finish.
            self.engine.abandon_all(f"an engine step ran longer than {deadline:g} s", reason=str(Trip.HUNG_STEP))
            if self.settings.exit_on_hung_step:
                time.sleep(1.0)  # let the error responses reach their clients
                log.error("exiting with status 70 so a supervisor restarts the server")
                self.exit_process(70)
            return

    # -- request preparation -----------------------------------------------------------------------
    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        # Messages, tools, tool calls and tool results as the chat template (or corral's default) renders them.
        try:
            tools = parse_tools(req.tools, req.tool_choice, req.parallel_tool_calls, limits=self.limits)
            return prompt_ids(self.loaded.tokenizer, req.messages, tools, self.tool_format)
        except (InvalidConstraint, MessageError) as exc:
            raise bad_request(str(exc), param=exc.param, code=getattr(exc, "code", None)) from exc

    def completion_prompt(self, req: CompletionRequest) -> list[int]:
        try:
            text = req.prompt_text()
        except ValueError as exc:
            raise bad_request(str(exc), param="prompt") from exc
        ids = [int(t) for t in self.loaded.tokenizer.encode(text, add_special_tokens=True)]
        if not ids:  # a tokenizer without BOS gives "" no token, and the engine needs one to start from
            raise bad_request("prompt is empty: give at least one token of text", param="prompt")
        return ids

    async def prepare(self, req: _Request, prompt_ids: list[int], *, prompt_param: str) -> Prepared:
        received = time.perf_counter()
        if not self.ready or not self.healthy:
            raise ApiError(503, "the server is starting or stopping; retry shortly", type_="service_unavailable")
        if req.model is not None and req.model not in (self.model_name, "default"):
            raise ApiError(
                404,
                f"model {req.model!r} is not served here; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )
        limit = self.engine.max_len
        if len(prompt_ids) >= limit:
            raise bad_request(
                f"the prompt is {len(prompt_ids)} tokens; this model's context is {limit} tokens "
                "(prompt + at least one generated token)",
                param=prompt_param,
                code="context_length_exceeded",
            )
        constraint, params = await self.off_loop(self._admission, req, len(prompt_ids))
        compiled = await self._compile(constraint) if constraint.spec is not None else None
        return Prepared(
            f"{next(self._ids)}-{uuid.uuid4().hex[:12]}", prompt_ids, params, constraint, compiled, received
        )

    def _admission(self, req: _Request, prompt_len: int) -> tuple[ConstraintRequest, SamplingParams]:
        """The request's constraint (schema checks, tools) and sampling parameters; runs off the event loop."""
        try:
            constraint = parse_constraint(
                req.response_format, req.structured_outputs, req.legacy_constraint(), limits=self.limits
            )
            if isinstance(req, ChatCompletionRequest):
                tools = parse_tools(req.tools, req.tool_choice, req.parallel_tool_calls, limits=self.limits)
                constraint = tool_constraint(tools, constraint, self.tool_format)
            self.backends.check_name(constraint.backend)
        except InvalidConstraint as exc:
            raise bad_request(str(exc), param=exc.param, code=exc.code) from exc
        except UnknownBackend as exc:
            raise bad_request(str(exc), param=constraint.backend_source) from exc
        return constraint, self._sampling_params(req, prompt_len)

    def _sampling_params(self, req: _Request, prompt_len: int) -> SamplingParams:
        room = self.engine.max_len - prompt_len
        max_tokens = max_tokens_for(
            req.max_completion_tokens, req.max_tokens, room=room, default=self.settings.default_max_tokens
        )
        bias: dict[int, float] = {}
        for key, value in (req.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError as exc:
                raise bad_request(f"logit_bias key {key!r} is not a token id", param="logit_bias") from exc
            if not 0 <= token < self.loaded.vocab_size or not -100 <= value <= 100:
                raise bad_request(
                    f"logit_bias {key}: token ids are 0..{self.loaded.vocab_size - 1}, biases -100..100",
                    param="logit_bias",
                )
            bias[token] = float(value)
        logprobs, top_logprobs = requested_logprobs(req)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
            seed=req.seed,
            stop=req.stop_list(),
            logit_bias=bias,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            ignore_eos=req.ignore_eos,
            max_revisions=req.max_revisions,
        )

    async def _compile_in_pool(
        self, work: Callable[[], CompileResult], started: asyncio.Event, deadline: float
    ) -> CompileResult:
        loop = asyncio.get_running_loop()
        # In the request's context, so the compile's log lines carry its request id (server/request_context.py).
        future = loop.run_in_executor(self._compile_pool, contextvars.copy_context().run, work)
        # The shield outlives a cancelled request (client gone, shutdown): collect its outcome so asyncio
        # does not report it as never retrieved; the result is cached by GrammarCache anyway.
        future.add_done_callback(lambda done: done.cancelled() or done.exception())
        try:
            # Every compile ahead in the queue ends within its own deadline, so a wait this long means the
            # compile threads are stuck or flooded: answer now rather than hold the request forever.
            await asyncio.wait_for(started.wait(), timeout=self.compile_queue_wait_s)
        except TimeoutError as exc:
            future.cancel()  # not started: it never will
            raise ApiError(
                503,
                f"no compile thread came free within {self.compile_queue_wait_s:g} s; retry shortly",
                type_="service_unavailable",
                code="compile_queue_full",
            ) from exc
        # GrammarCache enforces the deadline itself (killing the compile worker); a success may take up
        # to ~2x it (the parent rebuilds what the worker proved bounded). This wait is only a safety net.
        return await asyncio.wait_for(asyncio.shield(future), timeout=2 * deadline + 30)

    async def _compile(self, constraint: ConstraintRequest) -> CompileResult:
        assert constraint.spec is not None
        loop = asyncio.get_running_loop()
        started = asyncio.Event()
        spec, backend = constraint.spec, constraint.backend

        def work() -> CompileResult:
            loop.call_soon_threadsafe(started.set)
            return self.grammars.compile(spec, backend)

        deadline = self.settings.compile_timeout_s
        try:
            # A cache hit is answered here: compile bombs can hold every compile thread for the deadline.
            hit = self.grammars.lookup(spec, backend)
            result = hit if hit is not None else await self._compile_in_pool(work, started, deadline)
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

    async def stream(self, prepared: Prepared, *, deltas: bool = True) -> AsyncIterator[SeqOutput]:
        """Submit to the engine and yield its outputs; a cancelled consumer (disconnect) aborts."""
        self.check_capacity()
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[SeqOutput] = asyncio.Queue()

        def sink(out: SeqOutput) -> None:  # engine thread → event loop
            if not loop.is_closed():  # a final answer given as the server stops may find no loop to take it
                loop.call_soon_threadsafe(outputs.put_nowait, out)

        compiled = prepared.compiled
        backend = self.backends.for_request(compiled.backend, prepared.constraint.backend) if compiled else None
        seq = Sequence(
            request_id=prepared.request_id,
            prompt_ids=prepared.prompt_ids,
            params=prepared.params,
            sink=sink,
            matcher=backend.new_matcher(compiled.compiled) if backend and compiled else None,
            backend=backend,
            streaming=deltas,
        )
        seq.stats.arrival = prepared.received
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
        retryable = done.finish_reason in (INVALID_OUTPUT, str(Trip.DEAD_END))
        if retryable and prepared.constraint.backend == AUTO and prepared.compiled:
            retry = await self._fallback(prepared)
            if retry is not None:
                first_backend = prepared.compiled.backend
                done = await self._run_once(retry)
                done.fallback_from = first_backend
        return done

    async def _run_once(self, prepared: Prepared) -> Finished:
        async for out in self.stream(prepared, deltas=False):
            if out.finished:
                return await self.off_loop(self.finish, prepared, out)  # validates the whole answer
        raise RuntimeError("engine stream ended without a final output")

    async def _fallback(self, prepared: Prepared) -> Prepared | None:
        spec, used = prepared.constraint.spec, prepared.compiled
        assert spec is not None and used is not None
        for name in route(spec, self.backends.enabled):
            if name == used.backend:
                continue
            try:
                compiled = await self._compile(ConstraintRequest(spec, name, prepared.constraint.source))
            except ApiError:
                continue
            log.info("answer from %s failed validation; regenerating with %s", used.backend, name)
            return replace(prepared, compiled=compiled, request_id=f"{prepared.request_id}-{name}")
        return None

    def finish(self, prepared: Prepared, out: SeqOutput) -> Finished:
        seq = out.seq
        spec = prepared.constraint.spec
        check = self.check_output(spec, seq.text, out.finish_reason) if spec is not None else None
        reason = out.finish_reason or "stop"
        if reason == "stop" and check is not None and not check.valid:
            reason = INVALID_OUTPUT  # the grammar finished but the full contract does not hold
        if reason == "stop" and has_tool_calls(check):
            reason = "tool_calls"
        done = Finished(seq.text, reason, seq, check, prepared)
        self._observe(done)
        return done

    def _observe(self, done: Finished) -> None:
        m, stats, seq = self.metrics, done.seq.stats, done.seq
        m.requests.labels(done.finish_reason).inc()
        failed = done.check is not None and not done.check.valid
        if failed:
            m.failures.labels(_failure_class(seq)).inc()
        outcome = _failure_class(seq) if failed else done.finish_reason
        m.mode_outcomes.labels(request_mode(done.prepared.constraint.spec), outcome).inc()
        if stats.first_token is not None:
            m.ttft.observe(stats.first_token - stats.arrival)
        if stats.scheduled is not None:
            m.queue.observe(stats.scheduled - stats.arrival)
        if stats.finished is not None:
            m.e2e.observe(stats.finished - stats.arrival)
        for before, after in itertools.pairwise(stats.token_times):
            m.itl.observe(after - before)
        if seq.backend is not None:
            mask = m.mask.labels(seq.backend.name)
            for us in stats.mask_us:
                mask.observe(us / 1e6)
        m.forced.inc(stats.forced_tokens)
        m.generated.inc(len(seq.output_ids))

    @staticmethod
    def check_output(spec: GrammarSpec, text: str, finish_reason: str | None) -> OutputCheck:
        if finish_reason != "stop":
            return OutputCheck(False, f"generation ended by {finish_reason} before the grammar completed")
        return validate_output(spec, text)

    # -- response extras ---------------------------------------------------------------------------
    def extras(self, done: Finished) -> dict[str, Any]:
        prepared, seq, check = done.prepared, done.seq, done.check
        stats = seq.stats
        compiled = prepared.compiled
        end = stats.finished or time.perf_counter()
        generated = len(seq.output_ids)
        first = stats.first_token
        masks = sorted(stats.mask_us)
        timings = {
            "queue_ms": _ms(stats.arrival, stats.scheduled),
            "compile_ms": round(compiled.compile_ms, 3) if compiled else 0.0,
            "ttft_ms": _ms(stats.arrival, first),
            "tpot_ms": round((end - first) * 1000 / (generated - 1), 3) if first and generated > 1 else None,
            "mask_us_p50": round(_quantile(masks, 0.5), 1) if masks else None,
            "mask_us_p99": round(_quantile(masks, 0.99), 1) if masks else None,
            "forward_ms_mean": round(sum(stats.forward_ms) / len(stats.forward_ms), 3) if stats.forward_ms else None,
            "forward_steps": len(stats.forward_ms),
            "forced_tokens": stats.forced_tokens,
            "total_ms": _ms(stats.arrival, end),
        }
        grammar: dict[str, Any] | None = None
        if compiled is not None and prepared.constraint.spec is not None:
            grammar = {
                "kind": str(prepared.constraint.spec.kind),
                "backend": compiled.backend,
                # decode_safe: the engine compiled a relaxed schema and the contract guard enforced the rest
                "profile": "decode_safe" if compiled.compiled.spec.decode_safe else "full",
                "requested_backend": prepared.constraint.backend,
                "cache_hit": compiled.cache_hit,
                "schema_valid": check.valid if check and prepared.constraint.spec.embeds_schema else None,
                "valid": check.valid if check else None,
                "validation_error": check.error if check else None,
                "forced_tokens": stats.forced_tokens,
                "revisions": seq.revision.revisions,
                "watchdog": seq.trip,
                "failure": None if (check and check.valid) else _failure_class(seq),
                "fallback_from": done.fallback_from,
            }
        elif seq.revision.revisions or seq.trip:
            # Unconstrained, but revisions or a watchdog trip still need reporting.
            grammar = {
                "kind": None,
                "backend": None,
                "revisions": seq.revision.revisions,
                "watchdog": seq.trip,
                "failure": seq.trip,
            }
        return {"timings": timings, "grammar": grammar}


def _failure_class(seq: Sequence) -> str:
    if seq.trip is not None:
        return seq.trip
    if seq.finish_reason == "length":
        return "length"
    if seq.finish_reason == "error":
        return "engine_error"
    return "invalid_output"


def _ms(start: float | None, end: float | None) -> float | None:
    if start is None or end is None:
        return None
    return round((end - start) * 1000, 3)


def _quantile(sorted_values: list[float], q: float) -> float:
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]
