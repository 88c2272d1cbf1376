"""corral's extension of every response: `timings` (queue, compile, TTFT, TPOT, masks) and `grammar` (which
backend, profile, revisions, watchdog, validation and failure class) beside OpenAI's own fields."""

from __future__ import annotations

import time
from typing import Any

from corral.server.answer_metrics import failure_class
from corral.server.prepared import Finished


def response_extras(done: Finished) -> dict[str, Any]:
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
        "tpot_ms": _tpot_ms(first, end, generated + stats.stop_sampled),
        "mask_us_p50": round(_quantile(masks, 0.5), 1) if masks else None,
        "mask_us_p99": round(_quantile(masks, 0.99), 1) if masks else None,
        "forward_ms_mean": round(sum(stats.forward_ms) / len(stats.forward_ms), 3) if stats.forward_ms else None,
        "forward_steps": len(stats.forward_ms),
        "forced_tokens": stats.forced_tokens,
        # Speculative decoding (corral/server/engine/speculation.py): guesses fed, and those the model agreed with.
        "draft_tokens": seq.drafting.proposed,
        "draft_accepted": seq.drafting.accepted,
        "drafts": seq.drafting.drafts,
        # Greedy picks checked against the grammar instead of masked (corral/structured/lazy_masks.py), and the
        # fills a refused one needed.
        "masks_skipped": seq.lazy_mask.skipped,
        "masks_refilled": seq.lazy_mask.refilled,
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
            "closed": seq.closer.closed if seq.closer is not None else None,
            "failure": None if (check and check.valid) else failure_class(seq),
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


def _tpot_ms(first: float | None, end: float, tokens: int) -> float | None:
    """Time per output token after the first. A stop token the model sampled counts as one (as vLLM counts
    it): it took a step like any other, and leaving it out charged a short answer for a step it did not count
    (a 3-token answer ending on it by half again)."""
    return round((end - first) * 1000 / (tokens - 1), 3) if first and tokens > 1 else None


def _ms(start: float | None, end: float | None) -> float | None:
    if start is None or end is None:
        return None
    return round((end - start) * 1000, 3)


def _quantile(sorted_values: list[float], q: float) -> float:
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]
