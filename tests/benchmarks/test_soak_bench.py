"""`corral bench soak`'s harness: the hostile mix, the summary's targets, and a short run against the real
test server (every kind of request once or more; nothing lost, no 5xx, no fail-open)."""

from __future__ import annotations

import os
from collections import Counter

from conftest import RunningServer

from corral.benchmarks.soak.runner import Outcome, SoakConfig, SoakResult, run_soak
from corral.benchmarks.soak.workload import HOSTILE_KINDS, ORDINARY_KINDS, compile_bomb, hostile_phase


def test_hostile_phase_mixes_every_kind_and_compile_bombs_are_distinct() -> None:
    requests = hostile_phase(40, max_tokens=8)
    kinds = Counter(r.kind for r in requests)
    assert set(kinds) == set(ORDINARY_KINDS) | set(HOSTILE_KINDS)
    assert sum(kinds[k] for k in ORDINARY_KINDS) == 28  # 14 of every 20
    assert {r.stream for r in requests if r.ordinary} == {True, False}
    assert compile_bomb(1) != compile_bomb(2)


def test_summary_flags_lost_requests_and_missed_targets() -> None:
    result = SoakResult(outcomes=[
        Outcome("choice", "quiet", "200", 0.1), Outcome("choice", "quiet", "200", 0.1),
        Outcome("choice", "hostile", "200", 0.5), Outcome("regex", "hostile", "lost", 1.0, "ReadTimeout"),
        Outcome("cancel", "hostile", "cancelled", 0.25),
    ], samples={"after_warmup": {"rss_mb": 100.0}, "end": {"rss_mb": 110.0}})
    summary = result.summary()
    assert summary["lost_or_5xx"] == 1
    assert summary["targets"] == {"no_lost_or_5xx": False, "rss_growth_under_5pct": False,
                                  "hostile_p99_under_2x_quiet": False}
    assert summary["outcomes"]["hostile/cancel"] == {"cancelled": 1}


def test_short_soak_against_the_server(server: RunningServer) -> None:
    # 6 hostile requests of every kind (one compile bomb) among 14 ordinary ones, at concurrency 4.
    result = run_soak(SoakConfig(url=server.base_url, requests=20, concurrency=4, quiet_requests=5,
                                 max_tokens=16, pid=os.getpid()))
    summary = result.summary()
    assert summary["lost_or_5xx"] == 0, summary["problems"]
    assert summary["fail_open"] == 0 and summary["bad_shape"] == 0, summary["problems"]
    hostile = summary["outcomes"]
    assert hostile["hostile/compile_bomb"] == {"400": 1}
    assert hostile["hostile/malformed"] == {"400": 1}
    assert set(hostile["hostile/disconnect"]) <= {"disconnected", "200"}
    assert all(counts == {"200": sum(counts.values())} for name, counts in hostile.items()
               if name.split("/")[1] in ORDINARY_KINDS)
    assert summary["process"]["end"]["fds"] > 0 and summary["healthy_after"]
