"""Prometheus metrics, all under the `corral_` prefix (documented in docs/metrics.md)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_MASK_BUCKETS = (1e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2)


class Metrics:
    """One registry per app, so several servers in one process (tests) never collide."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram(
            "corral_time_to_first_token_seconds",
            "Arrival to first generated token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "corral_inter_token_latency_seconds",
            "Gap between consecutive decode steps of a request",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "corral_request_latency_seconds", "Arrival to last token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.queue = Histogram(
            "corral_request_queue_seconds", "Arrival to first scheduled step", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.compile = Histogram(
            "corral_grammar_compile_seconds",
            "Grammar compile time (cache misses)",
            ["backend"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.cache = Counter("corral_grammar_cache_total", "Grammar cache lookups", ["result"], registry=r)
        self.mask = Histogram(
            "corral_mask_fill_seconds", "Per-row token-mask fill time", ["backend"], buckets=_MASK_BUCKETS, registry=r
        )
        self.forced = Counter(
            "corral_forced_tokens_total", "Tokens appended by jump-forward without sampling", registry=r
        )
        self.drafted = Counter(
            "corral_draft_tokens_total", "Draft tokens (guesses) fed by speculative decoding", registry=r
        )
        self.draft_accepted = Counter(
            "corral_draft_accepted_tokens_total", "Draft tokens the model agreed with (kept in the answer)", registry=r
        )
        self.generated = Counter("corral_generated_tokens_total", "Output tokens (sampled and forced)", registry=r)
        self.requests = Counter("corral_requests_total", "Finished requests", ["finish_reason"], registry=r)
        self.failures = Counter(
            "corral_failures_total", "Requests that ended without a valid answer, by class", ["failure"], registry=r
        )
        self.mode_outcomes = Counter(
            "corral_mode_outcomes_total",
            "Finished requests by mediation mode (read off the constraint: docs/mediation.md) and outcome: the "
            "finish reason, or the failure class when the answer broke its contract",
            ["mode", "outcome"],
            registry=r,
        )
        self.rejected = Counter(
            "corral_rejected_requests_total", "Requests refused before generation", ["status"], registry=r
        )
        self.internal_errors = Counter(
            "corral_internal_errors_total", "Unexpected exceptions answered with a 500", registry=r
        )
        self.limit_refusals = Counter(
            "corral_limit_refusals_total", "Requests refused by a request limit", ["limit"], registry=r
        )
        self.closed = Counter(
            "corral_closed_answers_total",
            "Structured answers closed early with the grammar's shortest completion, by why",
            ["why"],
            registry=r,
        )
        self.trips = Counter(
            "corral_watchdog_trips_total", "Watchdog trips by kind (see README: finish_reason)", ["kind"], registry=r
        )
        self.prefix_queried = Counter(
            "corral_prefix_cache_queried_tokens_total", "Prompt tokens looked up in the prefix cache", registry=r
        )
        self.prefix_hits = Counter(
            "corral_prefix_cache_hit_tokens_total",
            "Prompt tokens whose KV was reused from the prefix cache",
            registry=r,
        )
        self.prefix_host_bytes = Gauge(
            "corral_prefix_cache_host_bytes",
            "Bytes of prompt blocks kept in host memory after their slot was reused (--prefix-cache-ram-mb)",
            registry=r,
        )
        self.running = Gauge("corral_running_requests", "Sequences in the running batch", registry=r)
        self.waiting = Gauge("corral_waiting_requests", "Sequences waiting for a batch slot", registry=r)

    def prefix_lookup(self, queried: int, hit: int) -> None:
        self.prefix_queried.inc(queried)
        self.prefix_hits.inc(hit)

    def bind_gauges(self, running: Callable[[], float], waiting: Callable[[], float]) -> None:
        self.running.set_function(running)
        self.waiting.set_function(waiting)
