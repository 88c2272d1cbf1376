"""Per-token mask cost of each backend on each case (corral/benchmarks/kinds/cases.py), the backends side by side.

Each backend compiles the case once (as the server's cache would keep it); then, round after round, a fresh
matcher is teacher-forced through the case's answer, timing every `fill_bitmask` (one per token, plus the final
mask that must allow a stop token) and, separately, what the engine thread does after sampling (accept_token
and the jump-forward probe, `forced_tokens`). The batch pass does the same with `batch` matchers in step,
filled by the backend's own `fill_bitmasks`, as the engine fills a step's rows of one backend in one call.
A fixed answer replays one path, which a lazy engine has cached after the first round; the random tiny model
walks a new path every request. So each round also forces a random walk (uniform over the tokens every
backend's mask allows, a new seed each round, the same walks for every backend) and reports its cost apart.
Backends alternate inside every round (their order flips each round) so both see the same machine load; a
round's cost is its mean per token, and the report takes the median over rounds: the first round (a fresh
compile's first matcher, where llguidance builds its lexer lazily) is reported apart as `cold`."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from corral.benchmarks.kinds.cases import Case
from corral.grammar_engines.bitmask import allowed_ids
from corral.grammar_engines.protocol import CompiledGrammar, CompileError, SamplerBackend, allocate_bitmask
from corral.grammar_engines.registry import BackendSet
from corral.grammars.features import route


@dataclass
class KindResult:
    case: str
    kind: str
    backend: str
    tokens: int
    compile_ms: float | None = None
    cold_fill_us: float | None = None  # the first matcher's mean fill per token
    fill_us: float | None = None  # median over the other rounds of the mean fill per token
    walk_us: float | None = None  # median over the random walks of the mean fill per token
    walk_tokens: float | None = None  # the walks' median length
    after_us: float | None = None  # median per token: accept_token + forced_tokens
    batch_step_us: float | None = None  # median per step of one fill_bitmasks call over `batch` rows
    error: str | None = None  # refused to compile, or refused the case's answer (a dialect difference)
    rounds: list[float] = field(default_factory=list)  # each round's mean fill per token

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Rejected(Exception):
    pass


def _bit(bits: Any, token: int) -> bool:
    return bool((int(bits[token >> 5]) >> (token & 31)) & 1)


def force_one(impl: SamplerBackend, compiled: CompiledGrammar, tokens: Sequence[int], bitmask: torch.Tensor,
              *, must_end: bool = True) -> tuple[float, float]:
    """One matcher through `tokens`: (mean fill µs per mask, mean accept + jump-forward probe µs per token)."""
    matcher = impl.new_matcher(compiled)
    bits = bitmask[0].numpy()
    fill_ns = after_ns = 0
    for index, token in enumerate(tokens):
        t0 = time.perf_counter_ns()
        matcher.fill_bitmask(bitmask, 0)
        t1 = time.perf_counter_ns()
        ok = matcher.accept_token(token)
        matcher.forced_tokens()
        after_ns += time.perf_counter_ns() - t1
        fill_ns += t1 - t0
        if not ok or not _bit(bits, token):
            raise _Rejected(f"{impl.name} refused token {index} ({token}) of the answer")
    t0 = time.perf_counter_ns()
    matcher.fill_bitmask(bitmask, 0)
    fill_ns += time.perf_counter_ns() - t0
    if must_end and not matcher.can_terminate():
        raise _Rejected(f"{impl.name} cannot end after the answer")
    return fill_ns / 1000 / (len(tokens) + 1), after_ns / 1000 / len(tokens)


def force_batch(impl: SamplerBackend, compiled: CompiledGrammar, tokens: Sequence[int], bitmask: torch.Tensor,
                ) -> float:
    """`bitmask`'s rows of matchers in step through `tokens`: mean µs per `fill_bitmasks` call."""
    rows = list(range(bitmask.shape[0]))
    matchers = [impl.new_matcher(compiled) for _ in rows]
    total_ns = 0
    for token in [*tokens, None]:
        t0 = time.perf_counter_ns()
        impl.fill_bitmasks(matchers, bitmask, rows)
        total_ns += time.perf_counter_ns() - t0
        if token is not None:
            for matcher in matchers:
                matcher.accept_token(token)
    return total_ns / 1000 / (len(tokens) + 1)


def random_walk(engines: Sequence[tuple[SamplerBackend, CompiledGrammar]], vocab: int, stops: Sequence[int],
                seed: int, max_tokens: int) -> list[int]:
    """Up to `max_tokens` tokens, each drawn uniformly from what every engine's mask allows besides a stop
    token (the engines differ at the edges: llguidance allows only the canonical token where the text is
    forced and no special token inside a string; xgrammar allows both)."""
    rng = random.Random(seed)
    matchers = [impl.new_matcher(compiled) for impl, compiled in engines]
    bitmask = allocate_bitmask(len(matchers), vocab)
    walk: list[int] = []
    while len(walk) < max_tokens:
        for row, matcher in enumerate(matchers):
            matcher.fill_bitmask(bitmask, row)
        words = np.bitwise_and.reduce(bitmask.numpy(), axis=0)
        ids = [t for t in allowed_ids(words, vocab).tolist() if t not in stops]
        if not ids:
            break
        token = rng.choice(ids)
        if not all([matcher.accept_token(token) for matcher in matchers]):
            break
        walk.append(token)
    return walk


def measure_case(backends: BackendSet, case: Case, rounds: int, batch: int, walk_tokens: int) -> list[KindResult]:
    names = list(backends.enabled)
    vocab = backends.tokenizer.vocab_size
    tokens = [int(t) for t in backends.tokenizer.hf_tokenizer.encode(case.text, add_special_tokens=False)]
    results = {name: KindResult(case.label, case.kind, name, len(tokens)) for name in names}
    compiled: dict[str, CompiledGrammar] = {}
    for name in names:
        impl = backends.get(name)
        t0 = time.perf_counter()
        try:
            compiled[name] = impl.compile(case.spec)
        except CompileError as exc:
            results[name].error = f"compile: {exc}"
            continue
        results[name].compile_ms = round((time.perf_counter() - t0) * 1000, 3)
    one = allocate_bitmask(1, vocab)
    many = allocate_bitmask(batch, vocab)
    engines = [(backends.get(name), grammar) for name, grammar in compiled.items()]
    stops = backends.tokenizer.stop_token_ids
    walks = [random_walk(engines, vocab, stops, seed, walk_tokens) if engines else [] for seed in range(rounds)]
    afters: dict[str, list[float]] = {name: [] for name in names}
    steps: dict[str, list[float]] = {name: [] for name in names}
    walked: dict[str, list[float]] = {name: [] for name in names}
    for index in range(rounds):
        for name in names if index % 2 == 0 else names[::-1]:
            result = results[name]
            if name not in compiled or result.error is not None:
                continue
            impl = backends.get(name)
            try:
                fill, after = force_one(impl, compiled[name], tokens, one)
            except _Rejected as exc:
                result.error = str(exc)
                continue
            result.rounds.append(round(fill, 3))
            afters[name].append(after)
            steps[name].append(force_batch(impl, compiled[name], tokens, many))
            if walks[index]:
                try:
                    walked[name].append(force_one(impl, compiled[name], walks[index], one, must_end=False)[0])
                except _Rejected as exc:  # an engine inconsistency: its mask allowed what it refuses
                    result.error = f"random walk {index}: {exc}"
    for name, result in results.items():
        if result.error is None and result.rounds:
            warm = result.rounds[1:] or result.rounds
            result.cold_fill_us = result.rounds[0]
            result.fill_us = round(statistics.median(warm), 3)
            result.after_us = round(statistics.median(afters[name]), 3)
            result.batch_step_us = round(statistics.median(steps[name]), 3)
            result.walk_us = round(statistics.median(walked[name]), 3) if walked[name] else None
            result.walk_tokens = statistics.median(len(w) for w in walks)
    return list(results.values())


def routed_first(backends: BackendSet, case: Case) -> str:
    """The backend `auto` tries first for `case` with the backends' declared traits."""
    order = route(case.spec, list(backends.enabled), backends.traits)
    return order[0] if order else "-"


def run_kinds(backends: BackendSet, cases: Sequence[Case], rounds: int, batch: int, walk_tokens: int,
              on_case: Callable[[Case], None]) -> list[KindResult]:
    torch.set_num_threads(1)
    backends.warm_up()
    results: list[KindResult] = []
    for case in cases:
        results += measure_case(backends, case, rounds, batch, walk_tokens)
        on_case(case)
    return results
