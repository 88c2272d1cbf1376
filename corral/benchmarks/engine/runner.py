"""Drives `Engine.step()` directly with JSONSchemaBench requests kept at a fixed concurrency.

The serving benchmark measures what a client sees, and on a small shared machine its HTTP client, event loop
and other processes move the numbers by 20-30 % between runs. This one keeps the engine's own work: the
same prompts (`bench serve`'s workload, rendered by the chat template), matchers as the server builds them
(`auto`: routed backend behind the contract guard), greedy, `max_tokens` each; unconstrained rows ignore EOS
and run to `max_tokens`. Per level it reports wall and engine-thread CPU milliseconds per step and tokens per
second; constrained answers that finished are checked against their full schema.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from corral.benchmarks.jsonschemabench.dataset import SchemaCase
from corral.benchmarks.serve.workload import messages
from corral.grammar_engines.compilation import CompileResult, GrammarCache, GrammarRejected
from corral.grammars.contract import validate_output
from corral.grammars.spec import GrammarSpec
from corral.server.engine import Engine, EngineConfig, SamplingParams
from corral.server.engine import Sequence as Seq
from corral.server.models import LoadedModel

AUTO = "auto"


@dataclass(frozen=True)
class Workload:
    case: SchemaCase
    prompt: list[int]
    compiled: CompileResult


@dataclass(frozen=True)
class EngineLevel:
    mode: str  # constrained | unconstrained
    concurrency: int
    requests: int
    tokens: int
    steps: int
    wall_ms_per_step: float
    cpu_ms_per_step: float  # the calling (engine) thread's CPU time
    tokens_per_s: float
    finished: int  # constrained answers that ended on their own (not max_tokens)
    valid: int  # of those, valid under the full schema

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def prepare(
    loaded: LoadedModel, grammars: GrammarCache, cases: Sequence[SchemaCase], wanted: int,
    on_case: Callable[[str], None],
) -> list[Workload]:
    """Compile candidates in order until `wanted` are accepted (refused ones are skipped)."""
    ready: list[Workload] = []
    for case in cases:
        if len(ready) == wanted:
            break
        on_case(case.case_id)
        try:
            compiled = grammars.compile(GrammarSpec.json_schema(case.schema), AUTO)
        except GrammarRejected:
            continue
        rendered = loaded.tokenizer.apply_chat_template(messages(case), add_generation_prompt=True,
                                                        tokenize=True, return_dict=True)
        ready.append(Workload(case, [int(t) for t in rendered["input_ids"]], compiled))
    return ready


def run_level(
    engine: Engine, grammars: GrammarCache, work: Sequence[Workload], *, mode: str, concurrency: int,
    requests: int, max_tokens: int, on_done: Callable[[], None],
) -> EngineLevel:
    constrained = mode == "constrained"

    def make(i: int) -> tuple[Seq, Workload]:
        item = work[i % len(work)]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=not constrained)
        backend = grammars.backends.for_request(item.compiled.backend, AUTO) if constrained else None
        matcher = backend.new_matcher(item.compiled.compiled) if backend is not None else None
        seq = Seq(request_id=f"{mode}-{i}", prompt_ids=list(item.prompt), params=params, sink=lambda out: None,
                  matcher=matcher, backend=backend, streaming=False)
        return seq, item

    live: list[tuple[Seq, Workload]] = []
    submitted = done = tokens = steps = finished = valid = 0
    wall_start, cpu_start = time.perf_counter(), time.thread_time()
    while done < requests:
        while len(live) < concurrency and submitted < requests:
            seq, item = make(submitted)
            submitted += 1
            engine.add_request(seq)
            live.append((seq, item))
        engine.step()
        steps += 1
        for seq, item in [pair for pair in live if pair[0].is_finished]:
            live.remove((seq, item))
            done += 1
            tokens += len(seq.output_ids)
            if constrained and seq.finish_reason == "stop":
                finished += 1
                text = engine.loaded.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
                valid += validate_output(GrammarSpec.json_schema(item.case.schema), text).valid
            on_done()
    wall = time.perf_counter() - wall_start
    cpu = time.thread_time() - cpu_start
    return EngineLevel(mode, concurrency, requests, tokens, steps, wall * 1000 / steps, cpu * 1000 / steps,
                       tokens / wall, finished, valid)


def new_engine(loaded: LoadedModel, max_batch: int, thread_choices: tuple[int, ...] = ()) -> Engine:
    """thread_choices: as the server passes them (Settings.cpu_thread_choices on CPU), so each forward runs on
    the thread count its measurements chose, as it does behind `corral serve`."""
    return Engine(loaded, EngineConfig(max_batch=max_batch, thread_choices=thread_choices))
