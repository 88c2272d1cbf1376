"""`corral bench quality`: the suites' ground truth, the requests, the judge on hand-made answers, the summary,
and one short run of the command against the session's corral (corral-tiny), with the same server as a peer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import run_bench

from corral.benchmarks.quality.answers import Answer, judge
from corral.benchmarks.quality.bodies import Mode, Sampling, corral_mode, peer_modes, request
from corral.benchmarks.quality.report import summarise, table_rows
from corral.benchmarks.quality.runner import QualityBenchConfig
from corral.benchmarks.quality.scoring import first_json_value, same, schema_error, score
from corral.benchmarks.quality.suites import ITEMS, SUITES, load_tasks
from corral.benchmarks.serve.client import Reply

TASKS = {t.name: t for t in load_tasks()}
PERSON, ORDER, CHOICE, TOOL = TASKS["person"], TASKS["order"], TASKS["sentiment_choice"], TASKS["tool_call"]


# -- suites ------------------------------------------------------------------------------------------------
def test_suites_are_deterministic_and_their_truth_fits_their_own_shape() -> None:
    again = {t.name: t for t in load_tasks()}
    for task in TASKS.values():
        assert task == again[task.name]
        assert len(task.items) == ITEMS and len({i.item_id for i in task.items}) == ITEMS
        assert task.example.text not in {i.text for i in task.items}
        for item in (task.example, *task.items):
            if task.kind == "tool":
                tool = next(t["function"] for t in task.tools if t["function"]["name"] == item.truth["name"])
                assert schema_error(tool["parameters"], item.truth["arguments"]) is None, item
            else:
                assert schema_error(task.schema, item.truth) is None, item
            assert score(task, item, task.answer_text(item), None).exact or task.kind == "tool"
    assert [t.name for t in load_tasks(["order", "person"], 3)] == ["person", "order"]
    assert all(len(t.items) == 3 for t in load_tasks(None, 3))
    with pytest.raises(ValueError, match="unknown task nope"):
        load_tasks(["nope"])
    assert set(SUITES) == set(TASKS)


def test_prompts_are_what_a_user_writes() -> None:
    item = PERSON.items[0]
    prompt = PERSON.completion_prompt(item, 1)
    assert prompt.startswith(PERSON.instruction) and prompt.endswith(f"Sentence: {item.text}\nJSON:")
    assert '{"name": "Alice Moreau", "age": 31, "city": "Oslo"}' in prompt
    assert "Alice" not in PERSON.completion_prompt(item, 0)
    chat = PERSON.chat_messages(item, 1)
    assert [m["role"] for m in chat] == ["user", "assistant", "user"] and item.text in chat[-1]["content"]
    assert TOOL.chat_messages(TOOL.items[0], 1) == [{"role": "user", "content": TOOL.items[0].text}]


# -- requests ----------------------------------------------------------------------------------------------
def test_each_mode_spells_its_constraint() -> None:
    item, sampling = PERSON.items[0], Sampling(max_tokens=32)
    api, path, body = request(PERSON, item, corral_mode("unconstrained"), api="completions", shots=1,
                              sampling=sampling)
    assert (api, path) == ("completions", "/v1/completions") and body["stop"] == ["\n\n"]
    assert "structured_outputs" not in body and body["max_tokens"] == 32 and body["temperature"] == 0.0
    _, _, body = request(PERSON, item, corral_mode("xgrammar"), api="chat", shots=0, sampling=sampling,
                         extra={"close_answers": False})
    assert body["structured_outputs"] == {"json": PERSON.schema, "backend": "xgrammar"} and "stop" not in body
    assert body["close_answers"] is False and body["messages"][-1]["role"] == "user"
    _, _, body = request(CHOICE, CHOICE.items[0], corral_mode("auto"), api="completions", shots=1,
                         sampling=sampling)
    assert body["structured_outputs"] == {"choice": ["positive", "negative", "neutral"], "backend": "auto"}
    # Tools exist only in chat: a tool task goes there whatever --api says; unconstrained still sees the tools.
    api, path, body = request(TOOL, TOOL.items[0], corral_mode("llguidance"), api="completions", shots=1,
                              sampling=sampling)
    assert (api, path, body["tool_choice"]) == ("chat", "/v1/chat/completions", "required")
    assert body["structured_outputs"] == {"backend": "llguidance"} and len(body["tools"]) == 3
    _, _, body = request(TOOL, TOOL.items[0], Mode("unconstrained"), api="chat", shots=1, sampling=sampling)
    assert body["tool_choice"] == "none" and "structured_outputs" not in body
    # A peer's own fields.
    _, constrained = peer_modes("response_format")
    _, _, body = request(PERSON, item, constrained, api="completions", shots=1, sampling=sampling, model="m")
    assert body["response_format"]["json_schema"]["schema"] == PERSON.schema and body["model"] == "m"
    _, _, body = request(CHOICE, CHOICE.items[0], peer_modes("json_schema")[1], api="chat", shots=1,
                         sampling=sampling)
    assert body["json_schema"] == {"type": "string", "enum": ["positive", "negative", "neutral"]}
    with pytest.raises(ValueError, match="unknown mode"):
        corral_mode("outlines")
    with pytest.raises(ValueError, match="--api"):
        request(PERSON, item, Mode("unconstrained"), api="responses", shots=1, sampling=sampling)
    with pytest.raises(ValueError, match="--shots"):
        QualityBenchConfig(out=Path("x"), shots=3)
    with pytest.raises(ValueError, match="peer-constraint"):
        QualityBenchConfig(out=Path("x"), peer_constraint="guided_json")


# -- judging -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "expected"), [
    ('{"a": 1}', (True, {"a": 1})),
    ('Sure! Here it is: {"a": "x}"} and more {"b": 2}', (True, {"a": "x}"})),
    ('{not json} then [1, 2]', (True, [1, 2])),
    ('{"a": "quote \\" and {brace"}', (True, {"a": 'quote " and {brace'})),
    ('{"items": [{"name": "pen", "qty": 2}, {"name": "pe', (False, None)),  # cut: no inner item counts
    ("no json at all", (False, None)),
])
def test_first_json_value(text: str, expected: tuple[bool, Any]) -> None:
    assert first_json_value(text) == expected


def test_fields_compare_content_not_spelling() -> None:
    assert same("number", 1250.5, "1,250.50") and same("number", 58, 58.0) and not same("number", 58, True)
    assert same("text", "Tomás Berg", "  tomás   berg. ") and not same("text", "Oslo", ["Oslo"])
    assert same("label", "EUR", "eur") and not same("label", "EUR", "euro")
    truth = [{"name": "pen", "qty": 2}, {"name": "mug", "qty": 1}]
    assert same("items", truth, [{"name": "Mug", "qty": 1}, {"name": "pens", "qty": 2}])
    assert not same("items", truth, [*truth, {"name": "pen", "qty": 2}]) and not same("items", truth, "pen")


def test_a_json_answer_is_parsed_validated_and_scored_per_field() -> None:
    item = PERSON.items[0]
    name, age, city = item.truth["name"], item.truth["age"], item.truth["city"]
    right = score(PERSON, item, f'Answer: {{"name": "{name}", "age": {age}, "city": "{city}"}}\nNext')
    assert (right.parsed, right.valid, right.exact, right.field_accuracy) == (True, True, True, 1.0)
    # An age as a string: the content is right, the shape is not.
    loose = score(PERSON, item, json.dumps({"name": name, "age": str(age), "city": "Paris"}))
    assert (loose.parsed, loose.valid, loose.exact) == (True, False, False)
    assert loose.fields == {"name": True, "age": True, "city": False} and "is not of type" in (loose.error or "")
    assert loose.field_accuracy == pytest.approx(2 / 3)
    cut = score(PERSON, item, f'{{"name": "{name}", "age": {age}, "ci')
    assert (cut.parsed, cut.valid, cut.field_accuracy) == (False, False, 0.0)
    order = ORDER.items[1]
    repeated = {**order.truth, "items": [*order.truth["items"], order.truth["items"][0]]}
    verdict = score(ORDER, order, json.dumps(repeated))
    assert verdict.valid and verdict.overlong and verdict.fields["items"] is False and verdict.fields["total"]


def test_a_label_and_a_call_are_judged() -> None:
    item = CHOICE.items[0]
    truth = item.truth
    assert score(CHOICE, item, truth).exact and score(CHOICE, item, json.dumps(truth)).valid
    capital = score(CHOICE, item, f" {truth.capitalize()}. Because")
    assert (capital.parsed, capital.valid, capital.exact) == (True, False, True)
    assert not score(CHOICE, item, "  ").parsed

    call = TOOL.items[1]  # book_table
    args = call.truth["arguments"]
    as_call = [{"id": "c", "type": "function", "function": {"name": "book_table", "arguments": json.dumps(args)}}]
    assert score(TOOL, call, None, as_call).exact
    in_text = score(TOOL, call, 'I will call {"name": "book_table", "parameters": ' + json.dumps(
        {**args, "time": "7pm"}) + "}")
    assert in_text.parsed and not in_text.valid and in_text.fields == {
        "name": True, "restaurant": True, "people": True, "time": False}
    wrong = score(TOOL, call, None, [{"function": {"name": "book_taxi", "arguments": "{}"}}])
    assert wrong.parsed and not wrong.valid and "no function named 'book_taxi'" in (wrong.error or "")
    not_a_string = score(TOOL, call, None, [{"function": {"name": "book_table", "arguments": args}}])
    assert not not_a_string.parsed


def _reply(text: str, finish: str = "stop", precise: str | None = None, tokens: int = 10) -> Reply:
    choice = {"index": 0, "text": text, "finish_reason": finish, "corral_finish_reason": precise or finish}
    return Reply("ok", 200, {"choices": [choice], "usage": {"completion_tokens": tokens}}, client_ms=500.0)


def test_the_summary_counts_rates_tokens_and_finish_reasons() -> None:
    item = PERSON.items[0]
    good = json.dumps(item.truth)

    def answer(reply: Reply, mode: str = "auto") -> Answer:
        return judge(PERSON, item, server="corral", mode=mode, api="completions", reply=reply)

    answers = [
        answer(_reply(good, tokens=20)),
        answer(_reply(good, "length", "closed", tokens=30)),  # closed early, valid
        answer(_reply('{"name": "x", "ag', "length", tokens=40)),  # cut
        answer(Reply("refused", 400, error="bad schema")),
        answer(_reply("prose", tokens=5), mode="unconstrained"),
    ]
    rows = {r["mode"]: r for r in summarise(answers)}
    auto = rows["auto"]
    assert (auto["items"], auto["answered"], auto["refused"]) == (4, 3, 1)
    assert (auto["parse_rate"], auto["valid_rate"], auto["exact_accuracy"]) == (0.5, 0.5, 0.5)
    assert auto["per_field"] == {"name": 0.5, "age": 0.5, "city": 0.5}
    assert auto["tokens_per_answer"] == 30 and auto["tokens_per_s"] == pytest.approx(90 / 1.5)
    assert auto["finish_reasons"] == {"stop": 1, "closed": 1, "length": 1, "refused": 1}
    assert (auto["closed"], auto["cut"]) == (1, 1)
    assert rows["unconstrained"]["parse_rate"] == 0.0
    assert table_rows([auto])[0][:8] == ["corral", "person", "auto", "4", "50%", "50%", "50%", "50%"]
    # A constrained answer that ended by itself and does not validate: the shape was not enforced (a cut one is
    # not counted, nor free text).
    assert auto["unenforced"] == 0 and rows["unconstrained"]["unenforced"] == 0
    peer = [judge(PERSON, item, server="peer", mode="response_format", api="completions", reply=r) for r in
            (_reply('Sure: {"name": "x"}', tokens=9), _reply(good, tokens=20), _reply("{", "length", tokens=128))]
    assert summarise(peer)[0]["unenforced"] == 1


# -- the command -------------------------------------------------------------------------------------------
def test_a_refused_flag_exits_2_before_any_work() -> None:
    done = run_bench("quality", "--tasks", "person,nope", "--server", "http://127.0.0.1:9")
    assert done.returncode == 2 and "unknown task nope" in done.stdout


@pytest.mark.timeout(240)
def test_a_short_run_against_corral_and_a_peer_writes_the_report(server: Any, tmp_path: Path) -> None:
    out = tmp_path / "quality"
    done = run_bench("quality", "--server", server.base_url, "--items", "2", "--max-tokens", "24",
                     "--concurrency", "4", "--peer-url", server.base_url, "--peer-constraint", "response_format",
                     "--out", str(out), timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((out / "results.json").read_text())
    assert (out / "quality.png").stat().st_size > 0 and "corral bench quality" in done.stdout
    rows = report["summary"]
    modes = {"corral": ["unconstrained", "xgrammar", "llguidance", "auto"],
             "peer": ["unconstrained", "response_format"]}
    assert [(r["server"], r["task"], r["mode"]) for r in rows] == [
        (side, task, mode) for side in modes for task in SUITES for mode in modes[side]]
    for row in rows:
        assert row["items"] == 2 and row["answered"] + row["refused"] + row["errors"] == 2
        for key in ("parse_rate", "valid_rate", "exact_accuracy", "field_accuracy"):
            assert 0.0 <= row[key] <= 1.0, (row, key)
        assert row["valid_rate"] <= row["parse_rate"] and row["exact_accuracy"] <= row["field_accuracy"] + 1e-9
        assert sum(row["finish_reasons"].values()) == 2
    assert len(report["answers"]) == 2 * len(SUITES) * 6 and report["peer"]["constraint"] == "response_format"
    # corral's promise, checked by the benchmark's own judge: a constrained answer it finished is valid.
    for a in report["answers"]:
        finished = a["corral_finish_reason"] in ("stop", "closed", "tool_calls")
        if a["server"] == "corral" and a["mode"] != "unconstrained" and a["status"] == "ok" and finished:
            assert a["valid"], a
        if a["server"] == "corral" and a["mode"] in ("xgrammar", "llguidance") and a["status"] == "ok":
            assert a["backend"] == a["mode"], a
    assert report["tasks"]["tool_call"]["tools"] == ["get_weather", "book_table", "convert_currency"]
