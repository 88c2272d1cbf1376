"""masks mode: compile, then teacher-force every test instance token by token (MaskBench style)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from corral.benchmarks.jsonschemabench.compile_timeout import as_record, compile_with_timeout
from corral.benchmarks.jsonschemabench.conformance import failing_keyword, meta_valid
from corral.benchmarks.jsonschemabench.dataset import SchemaCase
from corral.benchmarks.jsonschemabench.latency import LatencyHistogram, percentile
from corral.grammar_engines.protocol import CompiledGrammar, SamplerBackend, TokenizerSpec, allocate_bitmask
from corral.grammar_engines.registry import BackendSet
from corral.grammars.json_walk import objects_in
from corral.grammars.spec import GrammarSpec

# corral's backends emit ", " between items and ": " after keys, with no other whitespace.
ITEM_SEPARATOR, KEY_SEPARATOR = ", ", ": "


def serializations(value: Any, schema: Any = None) -> list[str]:
    """The compact texts to try for one instance: sorted keys first, then the data set's own order, then (given
    the schema) the order the engines emit, each object's keys as the schema declares its properties: by first
    declaration anywhere in the schema, and by the widest declaration of all of an object's keys (two
    approximations where subschemas declare the same names differently). An instance accepted in none of them
    counts as refused."""
    seps = (ITEM_SEPARATOR, KEY_SEPARATOR)
    texts = [json.dumps(value, sort_keys=True, separators=seps, ensure_ascii=False)]
    texts.append(json.dumps(value, separators=seps, ensure_ascii=False))
    if schema is not None:
        rank = declared_order(schema)
        texts.append(json.dumps(_reordered(value, rank), separators=seps, ensure_ascii=False))
        # Per object: the widest `properties` that declares all of its keys (two subschemas may declare the same
        # names in different orders: Github_medium/o57539 has {qid, points} and {points, qid, qids}).
        declared = (node.get("properties") for node in objects_in(schema))
        declarations = sorted((list(d) for d in declared if isinstance(d, dict)), key=len, reverse=True)
        texts.append(json.dumps(_by_declaration(value, declarations), separators=seps, ensure_ascii=False))
    return list(dict.fromkeys(texts))


def _by_declaration(value: Any, declarations: list[list[str]]) -> Any:
    if isinstance(value, dict):
        names = next((d for d in declarations if set(value) <= set(d)), None)
        keys = sorted(value, key=names.index) if names is not None else list(value)
        return {k: _by_declaration(value[k], declarations) for k in keys}
    if isinstance(value, list):
        return [_by_declaration(item, declarations) for item in value]
    return value


def declared_order(schema: Any) -> dict[str, int]:
    """Each property name's position in the schema, in document order of the `properties` that declare it."""
    rank: dict[str, int] = {}
    for node in objects_in(schema):
        properties = node.get("properties")
        if isinstance(properties, dict):
            for name in properties:
                rank.setdefault(name, len(rank))
    return rank


def _reordered(value: Any, rank: dict[str, int]) -> Any:
    if isinstance(value, dict):
        keys = sorted(value, key=lambda k: rank.get(k, len(rank)))  # stable: undeclared keys keep their order
        return {k: _reordered(value[k], rank) for k in keys}
    if isinstance(value, list):
        return [_reordered(item, rank) for item in value]
    return value


@dataclass
class ForcedRun:
    """One teacher-forced pass of a token sequence through a fresh matcher."""

    accepted: bool  # every token accepted and the grammar can end there
    rejected_at: int | None  # index of the first refused token; None when all were accepted
    mask_us: list[float] = field(default_factory=list)
    mask_mismatch: int = 0  # mask bit and accept_token disagreed (an engine inconsistency)


def _allowed(bits: Any, token: int) -> bool:
    return bool((int(bits[token >> 5]) >> (token & 31)) & 1)


def teacher_force(
    impl: SamplerBackend, compiled: CompiledGrammar, tokens: list[int], stop_ids: tuple[int, ...],
    bitmask: torch.Tensor | None,
) -> ForcedRun:
    """Feed `tokens`; with a bitmask, also time the mask fill before every token and after the last
    (the mask that must allow a stop token) and check each mask against accept_token."""
    matcher = impl.new_matcher(compiled)
    bits = bitmask[0].numpy() if bitmask is not None else None
    run = ForcedRun(False, None)
    for index, token in enumerate(tokens):
        allowed = _timed_fill(matcher, bitmask, bits, token, run)
        ok = matcher.accept_token(token)
        if allowed is not None and allowed != ok:
            run.mask_mismatch += 1
        if not ok:
            run.rejected_at = index
            return run
    run.accepted = matcher.can_terminate()
    if bitmask is not None and bits is not None and stop_ids:
        _timed_fill(matcher, bitmask, bits, None, run)
        if any(_allowed(bits, s) for s in stop_ids) != run.accepted:
            run.mask_mismatch += 1
    return run


def _timed_fill(
    matcher: Any, bitmask: torch.Tensor | None, bits: Any, token: int | None, run: ForcedRun
) -> bool | None:
    if bitmask is None:
        return None
    start = time.perf_counter_ns()
    matcher.fill_bitmask(bitmask, 0)
    run.mask_us.append((time.perf_counter_ns() - start) / 1000)
    return None if token is None else _allowed(bits, token)


@dataclass(frozen=True)
class MaskContext:
    backends: BackendSet
    tokenizer: TokenizerSpec
    compile_timeout_s: float
    isolate: bool = False  # compile in killable worker processes, as the server does


def encode_instances(case: SchemaCase, tokenizer: TokenizerSpec) -> list[list[list[int]]]:
    """Token ids of every serialization of every test instance (shared by all backends of a case)."""
    encode = tokenizer.hf_tokenizer.encode
    return [
        [list(encode(text, add_special_tokens=False)) for text in serializations(t.data, case.schema)]
        for t in case.tests
    ]


def run_masks(ctx: MaskContext, case: SchemaCase, backend: str, encoded: list[list[list[int]]]) -> dict[str, Any]:
    """One record for `case` × `backend`."""
    record: dict[str, Any] = {"mode": "masks", "subset": case.subset, "schema": case.name, "backend": backend,
                              "meta_valid": meta_valid(case.schema)}
    outcome = compile_with_timeout(ctx.backends, GrammarSpec.json_schema(case.schema), backend,
                                   ctx.tokenizer.vocab_size, ctx.compile_timeout_s, isolate=ctx.isolate)
    record.update(as_record(outcome))
    record.update(valid_total=sum(t.valid for t in case.tests), invalid_total=sum(not t.valid for t in case.tests))
    if not outcome.declared or outcome.impl is None or outcome.compiled is None:
        return record
    bitmask = allocate_bitmask(1, ctx.tokenizer.vocab_size)
    stops = ctx.tokenizer.stop_token_ids
    latencies: list[float] = []
    sound_failures: list[dict[str, Any]] = []
    strict_failures: list[dict[str, Any]] = []
    mismatches = 0
    for index, (test, variants) in enumerate(zip(case.tests, encoded, strict=True)):
        # Masks are timed (TBM) on valid instances only, as MaskBench does; invalid ones just need accept.
        first = teacher_force(outcome.impl, outcome.compiled, variants[0], stops, bitmask if test.valid else None)
        latencies += first.mask_us
        mismatches += first.mask_mismatch
        runs = [first]
        for tokens in variants[1:]:
            if runs[-1].accepted:
                break
            runs.append(teacher_force(outcome.impl, outcome.compiled, tokens, stops, None))
        accepted = any(r.accepted for r in runs)
        if test.valid and not accepted:
            sound_failures.append({"test": index, "rejected_at": first.rejected_at, "tokens": len(variants[0])})
        elif not test.valid and accepted:
            keyword, where = failing_keyword(case.schema, test.data)
            strict_failures.append({"test": index, "keyword": keyword, "at": where})
    latencies.sort()
    record.update(
        sound_failures=sound_failures,
        strict_failures=strict_failures,
        mask_mismatch=mismatches,
        tbm_mean_us=round(sum(latencies) / len(latencies), 3) if latencies else None,
        tbm_p50_us=round(percentile(latencies, 0.5), 3) if latencies else None,
        tbm_p99_us=round(percentile(latencies, 0.99), 3) if latencies else None,
        tbm_max_us=round(latencies[-1], 3) if latencies else None,
        tbm=LatencyHistogram.of(latencies).to_json(),
    )
    return record
