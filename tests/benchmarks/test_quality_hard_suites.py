"""`corral bench quality`'s harder suites (hard_suites.py): their generation and ground truth, the judge on
nested fields and record multisets, and tool tasks asked under `tool_choice: auto` as well as `required`."""

from __future__ import annotations

import copy
import json
import re
from datetime import date
from pathlib import Path
from typing import Any

import pytest

from corral.benchmarks.quality.answers import NO_CALL, judge
from corral.benchmarks.quality.bodies import Mode, Sampling, corral_mode, peer_modes, request
from corral.benchmarks.quality.hard_suites import ELSEWHERE, OTHERS, in_words, ordinal_words
from corral.benchmarks.quality.many_tools_suite import MANY_TOOLS
from corral.benchmarks.quality.report import summarise
from corral.benchmarks.quality.runner import QualityBenchConfig
from corral.benchmarks.quality.scoring import same, schema_error, score
from corral.benchmarks.quality.suites import ITEMS, SUITES, load_tasks
from corral.benchmarks.quality.tasks import Field, Task
from corral.benchmarks.serve.client import Reply

HARD = ("contact_card", "records", "normalise_hard", "tool_choice_many")
TASKS = {t.name: t for t in load_tasks(list(HARD))}
CARD, RECORDS, DATES, MANY = (TASKS[name] for name in HARD)


# -- the suites --------------------------------------------------------------------------------------------
def test_the_hard_suites_come_after_the_others_and_are_the_same_on_every_call() -> None:
    assert list(SUITES)[-4:] == list(HARD)
    for name in HARD:
        task, again = TASKS[name], SUITES[name]()
        assert task == again and len(task.items) == ITEMS
        assert len({i.item_id for i in task.items}) == ITEMS and len({i.text for i in task.items}) == ITEMS
        assert task.example.text not in {i.text for i in task.items}
        assert task.example.truth not in [i.truth for i in task.items]


@pytest.mark.parametrize("name", HARD)
def test_every_truth_validates_against_its_task_and_scores_itself_right(name: str) -> None:
    task = TASKS[name]
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in task.tools}
    for item in (task.example, *task.items):
        if task.kind == "tool":
            assert schema_error(tools[item.truth["name"]], item.truth["arguments"]) is None, item
            call = [{"function": {"name": item.truth["name"], "arguments": json.dumps(item.truth["arguments"])}}]
            verdict = score(task, item, None, call)
        else:
            assert schema_error(task.schema, item.truth) is None, item
            verdict = score(task, item, task.answer_text(item))
        assert verdict.valid and verdict.exact and verdict.field_accuracy == 1.0, (item, verdict)


def test_a_contact_card_is_scored_leaf_by_leaf_and_the_phone_by_its_digits() -> None:
    item = CARD.items[0]
    assert [f.name for f in CARD.scored_fields(item)] == [
        "name", "company.name", "company.department", "address.street", "address.postcode", "address.city",
        "address.country", "phone"]
    wrong_city = copy.deepcopy(item.truth)
    wrong_city["address"]["city"] = "Vienna"
    verdict = score(CARD, item, json.dumps(wrong_city))
    assert verdict.valid and not verdict.exact and verdict.field_accuracy == pytest.approx(7 / 8)
    assert [k for k, right in verdict.fields.items() if not right] == ["address.city"]
    # A phone written as the message spells it is the right number in the wrong shape.
    spaced = {**item.truth, "phone": item.truth["phone"][:3] + " " + item.truth["phone"][3:]}
    verdict = score(CARD, item, json.dumps(spaced))
    assert verdict.exact and not verdict.valid and "does not match" in (verdict.error or "")
    # A flat answer: the nested leaves are missing, the top-level ones still count.
    flat = {"name": item.truth["name"], "company": item.truth["company"]["name"], "phone": item.truth["phone"]}
    verdict = score(CARD, item, json.dumps(flat))
    assert verdict.fields == {"name": True, "company.name": False, "company.department": False,
                              "address.street": False, "address.postcode": False, "address.city": False,
                              "address.country": False, "phone": True}


def test_contact_cards_carry_a_second_person_and_a_second_city() -> None:
    for item in CARD.items:
        text, truth = item.text, item.truth
        assert truth["name"] in text and truth["address"]["street"] in text and truth["address"]["postcode"] in text
        phones = [word for word in text.replace("(0)", "").split("+")[1:]]
        assert len(phones) == 2, item  # the signer's and the other person's
        assert truth["phone"] not in text  # written with spaces or dashes: E.164 is the answer's work
        assert any(other in text for other in OTHERS) and any(city in text for city in ELSEWHERE)


def test_records_are_a_multiset_compared_key_by_key() -> None:
    item = RECORDS.items[0]
    truth = item.truth
    shipments = truth["shipments"]
    reordered = {**truth, "shipments": [{**s, "destination": s["destination"].upper()} for s in shipments[::-1]]}
    assert score(RECORDS, item, json.dumps(reordered)).exact
    corrected_wrong = copy.deepcopy(truth)
    corrected_wrong["shipments"][0]["crates"] += 1
    missing = {**truth, "shipments": shipments[1:]}
    extra = {**truth, "shipments": [*shipments, {"id": "ZZ-999", "destination": "Oslo", "crates": 3}]}
    for wrong in (corrected_wrong, missing, extra):
        verdict = score(RECORDS, item, json.dumps(wrong))
        assert verdict.fields == {"warehouse": True, "shipments": False} and verdict.field_accuracy == 0.5
    assert score(RECORDS, item, json.dumps(extra)).overlong
    keys = (Field("id", "label"), Field("crates", "number"))
    assert same("records", [{"id": "AB-1", "crates": 2}], [{"id": "ab-1", "crates": "2", "note": "x"}], keys)
    assert not same("records", [{"id": "AB-1", "crates": 2}] * 2, [{"id": "AB-1", "crates": 2}], keys)
    assert not same("records", [{"id": "AB-1", "crates": 2}], [{"id": "AB-1"}], keys)
    assert not same("records", [{"id": "AB-1", "crates": 2}], {"id": "AB-1", "crates": 2}, keys)
    # The order's items are the same comparison with a noun and a number.
    assert same("items", [{"name": "pen", "qty": 2}], [{"name": "Pens", "qty": 2.0}])


def test_a_log_tells_a_correction_or_a_reroute_and_sometimes_a_cancellation() -> None:
    corrected = rerouted = cancelled = 0
    for item in RECORDS.items:
        text, truth = item.text, item.truth
        assert 3 <= len(truth["shipments"]) <= 5 and truth["warehouse"] in text
        assert 8 <= text.count(". ") + 1 <= 10
        for shipment in truth["shipments"]:
            assert shipment["id"] in text and shipment["destination"] in text
        corrected += "make that" in text or "Sorry" in text
        rerouted += "rerouted" in text
        cancelled += "cancelled" in text
    assert corrected + rerouted == ITEMS and corrected >= 5 and rerouted >= 5 and cancelled >= 5


def test_hard_dates_and_amounts_are_worked_out() -> None:
    assert in_words(2340) == "two thousand three hundred and forty" and in_words(1005) == "one thousand and five"
    assert ordinal_words(21) == "twenty-first" and ordinal_words(30) == "thirtieth" and ordinal_words(12) == "twelfth"
    texts = {i.text: i.truth for i in DATES.items}
    spellings = {  # each at least once: every date style, every amount style
        "day first": r"\d\d/\d\d/\d{4} \(day first\)", "month first": r"\d\d/\d\d/\d{4} \(US style, month first\)",
        "relative": r"(days?|week|fortnight) (after|before) \d+ [A-Z][a-z]+ \d{4}",
        "February's end": r"last day of February (2020|2024)", "year apart": r"^In \d{4}, .* on [A-Z][a-z]+ \d+\.$",
        "day in words": r"the [a-z-]+(st|nd|rd|th) of [A-Z]", "nth weekday": r"the [a-z]+ [A-Z][a-z]+day of",
        "two-digit year": r"\d(st|nd|rd|th) [A-Z][a-z]{2}\. '\d\d",
        "hundreds": r"[a-z]+teen hundred (dollars|euros|pounds|yen)",
        "k": r"\d(\.\d)?k ", "m": r"\d(\.\d)?m ", "a half": r" and a half (thousand|million) ",
        "in words": r"thousand [a-z -]+ (dollars|euros|pounds|yen)", "cents": r"(cents|pence)",
        "European": r"\d\.\d{3}(,\d\d)? ", "of a million": r" of a million ", "code after": r"\d{3} \d{3} [A-Z]{3}"}
    for name, pattern in spellings.items():
        assert any(re.search(pattern, text) for text in texts), name
    for text, truth in texts.items():
        assert truth["date"] not in text and date.fromisoformat(truth["date"])
        numerals = text.split("on ")[-1][:10].split("/")
        if "(day first)" in text:
            assert truth["date"] == "-".join(numerals[::-1])
        if "(US style" in text:
            assert truth["date"] == "-".join((numerals[2], numerals[0], numerals[1]))


def test_one_call_among_twelve_tools_each_asked_with_look_alikes_asked_twice() -> None:
    assert len(MANY.tools) == len(MANY_TOOLS) == 12
    asked = [i.truth["name"] for i in MANY.items]
    assert set(asked) == {t["function"]["name"] for t in MANY.tools}
    for pair in (("get_weather", "get_forecast"), ("convert_currency", "get_exchange_rate"),
                 ("create_reminder", "set_timer")):
        assert all(asked.count(name) == 2 for name in pair)
    # Optional parameters appear in some truths and not in others, as the requests state them or not.
    weather = [i.truth["arguments"] for i in MANY.items if i.truth["name"] == "get_weather"]
    assert {frozenset(a) for a in weather} == {frozenset({"city"}), frozenset({"city", "unit"})}
    item = next(i for i in MANY.items if i.truth["name"] == "get_forecast")
    call = [{"function": {"name": "get_weather", "arguments": json.dumps({"city": item.truth["arguments"]["city"]})}}]
    verdict = score(MANY, item, None, call)
    assert verdict.valid and not verdict.exact and verdict.fields["name"] is False and verdict.fields["city"]
    assert MANY.chat_messages(item, 1) == [{"role": "user", "content": item.text}]


# -- tool_choice -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("task", [MANY, load_tasks(["tool_call"])[0]], ids=lambda t: t.name)
def test_tool_choice_reaches_the_constrained_requests_and_not_the_free_one(task: Task) -> None:
    item, sampling = task.items[0], Sampling()
    for choice in ("required", "auto"):
        _, path, body = request(task, item, corral_mode("llguidance"), api="completions", shots=1,
                                sampling=sampling, tool_choice=choice)
        assert path == "/v1/chat/completions" and body["tool_choice"] == choice
        assert body["structured_outputs"] == {"backend": "llguidance"} and len(body["tools"]) == len(task.tools)
        _, _, body = request(task, item, peer_modes("structured_outputs")[1], api="chat", shots=1,
                             sampling=sampling, tool_choice=choice)
        assert body["tool_choice"] == choice
        _, _, body = request(task, item, Mode("unconstrained"), api="chat", shots=1, sampling=sampling,
                             tool_choice=choice)
        assert body["tool_choice"] == "none"
    _, _, body = request(task, item, corral_mode("auto"), api="chat", shots=1, sampling=sampling)
    assert body["tool_choice"] == "required"  # the default, today's behaviour
    with pytest.raises(ValueError, match="--tool-choice"):
        request(task, item, corral_mode("auto"), api="chat", shots=1, sampling=sampling, tool_choice="none")
    # A JSON task sends no tool_choice whatever the option says.
    _, _, body = request(CARD, CARD.items[0], corral_mode("auto"), api="chat", shots=1, sampling=sampling,
                         tool_choice="auto")
    assert "tool_choice" not in body and "tools" not in body


def test_the_option_is_in_the_config_and_refused_when_unknown() -> None:
    assert QualityBenchConfig(out=Path("x")).as_dict()["tool_choice"] == "required"
    assert QualityBenchConfig(out=Path("x"), tool_choice="auto").as_dict()["tool_choice"] == "auto"
    with pytest.raises(ValueError, match="--tool-choice"):
        QualityBenchConfig(out=Path("x"), tool_choice="named")


def _chat(message: dict[str, Any], finish: str) -> Reply:
    choice = {"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish,
              "corral_finish_reason": finish}
    return Reply("ok", 200, {"choices": [choice], "usage": {"completion_tokens": 12}}, client_ms=100.0)


def test_words_under_auto_are_a_miss_with_their_own_finish_not_an_unenforced_answer() -> None:
    item = MANY.items[0]
    call = {"content": None, "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": item.truth["name"], "arguments": json.dumps(item.truth["arguments"])}}]}
    words = {"content": "I can't check live weather, but Bergen is often rainy."}
    answers = [judge(MANY, item, server="corral", mode="auto", api="chat", reply=_chat(message, finish),
                     tool_choice="auto") for message, finish in ((call, "tool_calls"), (words, "stop"))]
    right, miss = answers
    assert right.exact and right.called and right.finish == "tool_calls"
    assert (miss.parsed, miss.valid, miss.exact, miss.called, miss.finish) == (False, False, False, False, NO_CALL)
    assert "no call" in (miss.error or "") and miss.text == words["content"]
    row = summarise(answers)[0]
    assert row["no_call"] == 1 and row["unenforced"] == 0 and row["finish_reasons"] == {"tool_calls": 1, NO_CALL: 1}
    assert row["exact_accuracy"] == 0.5
    # A call written as JSON text (a peer that does not parse it) is judged as a call, not as words.
    as_text = judge(MANY, item, server="peer", mode="structured_outputs", api="chat", tool_choice="auto",
                    reply=_chat({"content": json.dumps(item.truth)}, "stop"))
    assert as_text.exact and not as_text.called and as_text.finish == "stop" and not as_text.words_for_a_call
    # The same words under `required` are a server that did not enforce the call.
    forced = judge(MANY, item, server="peer", mode="structured_outputs", api="chat", reply=_chat(words, "stop"),
                   tool_choice="required")
    row = summarise([forced])[0]
    assert forced.finish == "stop" and row["no_call"] == 0 and row["unenforced"] == 1
    # A JSON task's answer has neither.
    plain = judge(CARD, CARD.items[0], server="corral", mode="auto", api="chat",
                  reply=_chat({"content": CARD.answer_text(CARD.items[0])}, "stop"))
    assert plain.called is None and plain.tool_choice is None and plain.exact
