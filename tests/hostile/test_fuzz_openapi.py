"""Schemathesis over the server's own OpenAPI document (every operation, schema-conforming and
non-conforming cases), derandomized so every run sends the same requests: no 5xx, no lost connection, every
4xx in OpenAI's error shape, no fail-open, and the server healthy afterwards. `corral bench fuzz` runs the
same thing longer."""

from __future__ import annotations

import pytest
from conftest import RunningServer

from corral.benchmarks.fuzz.runner import FuzzReport, run_fuzz

REQUESTS = 60  # a minute or so on 2 busy cores; `corral bench fuzz` runs thousands


@pytest.fixture(scope="module")
def report(server: RunningServer) -> FuzzReport:
    fuzzed = run_fuzz(server.base_url, REQUESTS)
    print(f"\nfuzz: {fuzzed.summary()} per operation {fuzzed.as_json()['per_operation']}")
    return fuzzed


def test_fuzzed_requests_get_no_5xx_no_lost_connection_and_no_fail_open(report: FuzzReport) -> None:
    assert report.requests >= REQUESTS // 2
    assert len(report.distinct) > REQUESTS // 4
    assert not report.server_errors, report.server_errors[:3]
    assert not report.lost, report.lost[:3]
    assert not report.fail_open, report.fail_open[:3]
    assert report.statuses["2xx"] > 0 and report.statuses["4xx"] > 0  # both kinds of case were reached
    assert report.healthy_after


def test_fuzzed_requests_get_every_error_in_openai_shape(report: FuzzReport) -> None:
    assert not report.bad_shape, report.bad_shape[:3]
