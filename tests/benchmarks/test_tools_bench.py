"""`corral bench tools`: selection, requests, judging and counting on hand-made answers, and a run against
the session's corral (skipped, with the probe's reason, while the server has no tool support)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from corral.benchmarks.jsonschemabench.dataset import SchemaCase
from corral.benchmarks.tools.judge import ToolResult, judge_answer, judge_calls, summarize
from corral.benchmarks.tools.report import OUTCOMES, outcome_plot, per_subset, summary_rows
from corral.benchmarks.tools.runner import ToolsBenchConfig, select_cases
from corral.benchmarks.tools.workload import function_name, tools_request

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "tests" / "data" / "jsonschemabench_sample"

POINT = SchemaCase("Glaiveai2K", "make point.json", {
    "type": "object", "properties": {"x": {"type": "integer"}, "when": {"type": "string", "format": "date"}},
    "required": ["x"], "additionalProperties": False}, ())


def call(arguments: Any, name: str = "make_point") -> dict[str, Any]:
    return {"id": "call_0", "type": "function", "function": {"name": name, "arguments": arguments}}


def answer(calls: list[dict[str, Any]] | None, finish: str = "tool_calls", content: str | None = None
           ) -> dict[str, Any]:
    return {"choices": [{"index": 0, "finish_reason": finish,
                         "message": {"role": "assistant", "content": content, "tool_calls": calls}}],
            "usage": {"completion_tokens": 7}}


# -- workload --------------------------------------------------------------------------------------------
def test_selection_spans_the_subsets_and_names_are_valid_function_names() -> None:
    cases = select_cases(SAMPLE, 7)
    assert len(cases) == 7 and {c.subset for c in cases} == {p.name for p in SAMPLE.iterdir() if p.is_dir()}
    assert [c.case_id for c in cases] == [c.case_id for c in select_cases(SAMPLE, 7)]
    for case in select_cases(SAMPLE, 84):
        assert re.fullmatch(r"[a-zA-Z0-9_-]{1,64}", function_name(case))


def test_request_asks_for_one_function_with_the_schema_as_parameters() -> None:
    body = tools_request(POINT, max_tokens=32)
    assert body["tools"] == [{"type": "function", "function": {
        "name": "make_point", "description": "JSONSchemaBench Glaiveai2K/make point.json", "parameters": POINT.schema}}]
    assert body["tool_choice"] == "required" and body["max_tokens"] == 32 and "model" not in body
    named = tools_request(POINT, max_tokens=32, tool_choice="named", model="m")
    assert named["tool_choice"] == {"type": "function", "function": {"name": "make_point"}} and named["model"] == "m"
    with pytest.raises(ValueError, match="tool-choice"):
        tools_request(POINT, max_tokens=32, tool_choice="none")
    with pytest.raises(ValueError, match="schemas"):
        ToolsBenchConfig(data=SAMPLE, out=Path("x"), schemas=0)


# -- judging ---------------------------------------------------------------------------------------------
def test_each_call_is_judged_against_the_full_schema() -> None:
    verdicts = judge_calls(answer([
        call('{"x": 1, "when": "2024-02-29"}'),
        call('{"x": 1, "when": "2023-02-29"}'),  # the date format is checked, not just the type
        call('{"x": "1"}'),
        call('{"x": 1'),
        call({"x": 1}),  # arguments must be a JSON *string*
        call('{"x": 1}', name="other"),
    ])["choices"][0]["message"], POINT)
    assert [v.valid for v in verdicts] == [True, False, False, False, False, False]
    assert "format" in (verdicts[1].error or "") or "date" in (verdicts[1].error or "")
    assert "not JSON" in (verdicts[3].error or "")
    assert "not a JSON string" in (verdicts[4].error or "")
    assert not verdicts[5].name_ok and "unexpected function name 'other'" in (verdicts[5].error or "")


def test_summary_counts_every_outcome() -> None:
    results = [
        judge_answer(POINT, answer([call('{"x": 1}'), call('{"x": 2}')])),
        judge_answer(POINT, answer([call('{"x": "no"}')])),
        judge_answer(POINT, answer(None, finish="stop", content="prose")),
        judge_answer(POINT, answer([call('{"x": 3}')], finish="length")),
        ToolResult("S/a.json", "refused", 400, error="schema feature not supported: 'not' at /x"),
        ToolResult("S/b.json", "refused", 400, error="schema feature not supported: 'if' at /y"),
        ToolResult("S/c.json", "error", 500, error="boom"),
        ToolResult("S/d.json", "refused", 400, error="the prompt is 5640 tokens; the context is 4096 tokens"),
        ToolResult("S/e.json", "refused", 400, error="the prompt is 12843 tokens; the context is 4096 tokens"),
    ]
    s = summarize(results)
    assert (s.tried, s.refused, s.errors, s.answered) == (9, 4, 1, 4)
    assert (s.with_tool_calls, s.without_tool_calls, s.calls, s.calls_valid, s.calls_invalid) == (3, 1, 4, 3, 1)
    assert s.compliance == pytest.approx(3 / 4) and s.call_rate == pytest.approx(3 / 4)
    assert s.finish_mismatch == 1  # the call that finished with "length"
    assert s.finish_reasons == {"tool_calls": 2, "stop": 1, "length": 1}
    assert s.refusal_messages == {"schema feature not supported": 2,
                                  "the prompt is N tokens; the context is N tokens": 2}
    assert results[2].content == "prose"
    rows = dict(summary_rows(s.as_dict()))
    assert rows["compliance (valid ÷ returned calls)"] == "75.0% (3/4)"
    assert rows["refused (400)"] == "4"


def test_per_subset_outcomes_and_plot(tmp_path: Path) -> None:
    a, b = SchemaCase("A", "a.json", {}, ()), SchemaCase("B", "b.json", {}, ())
    results = [ToolResult("A/a.json", "refused", 400), ToolResult("B/b.json", "ok", 200, "stop")]
    counts = per_subset([a, b], results)
    assert counts["A"]["refused (400)"] == 1 and counts["B"]["no call"] == 1
    assert all(set(c) == set(OUTCOMES) and sum(c.values()) == 1 for c in counts.values())
    assert outcome_plot(counts, tmp_path / "p.png").stat().st_size > 0


# -- end to end ------------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_run_against_corral_validates_every_returned_call(server: Any, tmp_path: Path) -> None:
    from corral.benchmarks.tools.runner import ToolsUnsupported, run_tools_bench

    config = ToolsBenchConfig(data=SAMPLE, out=tmp_path / "tools", server=server.base_url, schemas=7,
                              concurrency=2, max_tokens=128)
    try:
        report = run_tools_bench(config)
    except ToolsUnsupported as exc:
        pytest.skip(str(exc))
    summary = report["summary"]
    assert summary["tried"] == 7 == summary["refused"] + summary["errors"] + summary["answered"]
    assert summary["errors"] == 0
    assert summary["calls"] > 0 and summary["calls_valid"] == summary["calls"]  # every returned call validates
    assert summary["wrong_name"] == 0
    saved = json.loads((tmp_path / "tools" / "results.json").read_text(encoding="utf-8"))
    assert saved["summary"] == summary and len(saved["results"]) == 7
    assert (tmp_path / "tools" / "tool_calls.png").stat().st_size > 0
