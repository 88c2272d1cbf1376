"""`corral bench drafts`: the request each task sends, and a pass of the plain task against the session's corral
(every answer runs to max_tokens, so drafts on and off are timed over the same tokens)."""

from __future__ import annotations

from typing import Any

import pytest

from corral.benchmarks.drafts.cases import SCHEMA, extraction_cases
from corral.benchmarks.drafts.runner import Side, body, run_side


def test_each_task_asks_for_its_own_answer() -> None:
    case = extraction_cases(1)[0]
    extract = body(Side("on", "http://x", "m", drafts=True), case, 64, "t-1")
    assert extract["response_format"]["json_schema"]["schema"] == SCHEMA and extract["drafts"] is True
    assert case.expected["email"] in extract["messages"][0]["content"]
    peer = body(Side("peer", "http://x", "m", constraint="json_schema"), case, 64, "t-1")
    assert peer["json_schema"] == SCHEMA and "drafts" not in peer
    free = body(Side("off", "http://x", "m", drafts=False, task="free"), case, 64, "t-1")
    assert "response_format" not in free and "ignore_eos" not in free
    assert case.expected["email"] in free["messages"][0]["content"]
    plain = body(Side("off", "http://x", "m", drafts=False, task="plain"), case, 64, "t-1")
    assert plain["ignore_eos"] is True and "response_format" not in plain
    assert case.expected["email"] not in plain["messages"][0]["content"]  # nothing in it to copy


@pytest.mark.timeout(300)
def test_a_plain_pass_runs_every_answer_to_max_tokens(server: Any) -> None:
    cases = extraction_cases(2)
    for drafts in (True, False):
        run = run_side(Side("corral", server.base_url, "corral-tiny", drafts=drafts, task="plain"), cases, 2, 0, 16)
        assert run.errors == 0 and run.answers == 2
        assert run.tokens == 2 * 16
        assert run.drafts == 0 or drafts  # a side that turned drafts off fed none
