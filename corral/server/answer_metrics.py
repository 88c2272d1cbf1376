"""A finished answer counted in the metrics, and what went wrong with one that failed its check."""

from __future__ import annotations

import itertools

from corral.grammars.spec import GrammarSpec
from corral.grammars.validation import OutputCheck
from corral.server.engine import Sequence
from corral.server.metrics import Metrics
from corral.server.modes import request_mode

ERROR = "error"  # an engine error ended the answer (seq.error says what)


def failure_class(seq: Sequence) -> str:
    """What went wrong with an answer that failed its check, for metrics and the response's extras."""
    if seq.trip is not None:
        return seq.trip
    if seq.finish_reason == "length":
        return "length"
    if seq.finish_reason == ERROR:
        return "engine_error"
    return "invalid_output"



def count_answer(
    metrics: Metrics, seq: Sequence, finish_reason: str, check: OutputCheck | None, spec: GrammarSpec | None
) -> None:
    """Count a finished answer in the metrics."""
    m, stats = metrics, seq.stats
    m.requests.labels(finish_reason).inc()
    failed = check is not None and not check.valid
    if failed:
        m.failures.labels(failure_class(seq)).inc()
    outcome = failure_class(seq) if failed else finish_reason
    m.mode_outcomes.labels(request_mode(spec), outcome).inc()
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
    m.drafted.inc(seq.drafting.proposed)
    m.draft_accepted.inc(seq.drafting.accepted)
    if seq.closer is not None and seq.closer.closed is not None:
        m.closed.labels(str(seq.closer.closed)).inc()
    m.generated.inc(len(seq.output_ids))
