"""The stall watchdog never ends a valid answer the grammar dictated, and still catches the model's own loops.

Seen as a user: `list[Literal["empty"]]` with exactly 30 items (Instructor's schema) ended `stall` every time,
because the repetition check counted the jump-forward tokens the grammar forced."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
import torch
from conftest import RunningServer

from corral.grammar_engines.bitmask import unpack_rows
from corral.grammar_engines.protocol import allocate_bitmask
from corral.structured.watchdog import StallDetector, WatchdogLimits, dictated

MODEL = "corral-tiny"
MESSAGES: list[Any] = [{"role": "user", "content": "Answer in the requested shape."}]


def _literal_list(items: int | None) -> dict[str, Any]:
    """What Instructor / pydantic send for `items: list[Literal["empty"]]` (sized with Field(min/max_length))."""
    array: dict[str, Any] = {"type": "array", "items": {"const": "empty", "type": "string"}, "title": "Items"}
    if items is not None:
        array.update(minItems=items, maxItems=items)
    return {"type": "object", "properties": {"items": array}, "required": ["items"], "title": "Answer"}


def _nested_models(depth: int) -> dict[str, Any]:
    """`depth` nested pydantic models, each with a free string field and its child."""
    schema: dict[str, Any] = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    for _ in range(depth):
        schema = {
            "type": "object",
            "properties": {"name": {"type": "string"}, "child": schema},
            "required": ["name", "child"],
        }
    return schema


LONG_CONST = {"type": "object", "properties": {"c": {"const": "abc " * 100}}, "required": ["c"]}

VALID_BUT_REPETITIVE = {
    "list_of_30_literals": _literal_list(30),
    "32_nested_models": _nested_models(32),
    "long_const_string": LONG_CONST,
}


def _ask(client: openai.OpenAI, schema: dict[str, Any], **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=1500,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        **kwargs,
    )


@pytest.mark.parametrize("name", list(VALID_BUT_REPETITIVE))
@pytest.mark.parametrize(("temperature", "seed"), [(0.0, 0), (1.0, 1)])
def test_repetitive_valid_answers_finish_stop(
    server: RunningServer, client: openai.OpenAI, name: str, temperature: float, seed: int
) -> None:
    schema = VALID_BUT_REPETITIVE[name]
    resp = _ask(client, schema, seed=seed, temperature=temperature)
    choice = resp.choices[0]
    assert (choice.model_extra or {}).get("corral_finish_reason", choice.finish_reason) == "stop", resp.model_extra
    assert choice.finish_reason == "stop"
    assert resp.model_extra["grammar"]["watchdog"] is None
    jsonschema.validate(json.loads(choice.message.content), schema)


@pytest.mark.parametrize("close_answers", [True, False])
def test_a_real_loop_under_a_grammar_is_still_caught(
    server: RunningServer, client: openai.OpenAI, close_answers: bool
) -> None:
    """The same array without a size: the model choosing `,` over `]` forever is its own loop. A JSON answer is
    closed as a runaway (valid, the array ended); with closing off, the watchdog's stall ends it."""
    service: Any = server.service
    comma = service.loaded.tokenizer.encode(",", add_special_tokens=False)[0]
    schema = _literal_list(None)
    resp = _ask(client, schema, seed=0, logit_bias={str(comma): 100}, extra_body={"close_answers": close_answers})
    choice = resp.choices[0]
    assert resp.usage.completion_tokens < 1500  # cut short, not run to the budget
    if close_answers:
        assert (choice.model_extra or {})["corral_finish_reason"] == "closed"
        assert resp.model_extra["grammar"]["closed"] == "runaway"
        jsonschema.validate(json.loads(choice.message.content), schema)
    else:
        assert (choice.model_extra or {})["corral_finish_reason"] == "stall"
        assert resp.model_extra["grammar"]["watchdog"] == "stall"


# -- the pieces, below the server ------------------------------------------------------------------------------
def _is_space(token: int) -> bool:
    return token == 0


def test_dictated_tokens_neither_count_nor_form_a_cycle() -> None:
    detector = StallDetector(WatchdogLimits(stall_whitespace_tokens=4, stall_repeat_tokens=6, max_cycle=2), _is_space)
    for _ in range(50):  # a forced cycle (7, 8) and forced whitespace: the grammar's doing
        assert not detector.observe([7, 8, 0], [False, False, False])
    for _ in range(3):  # three chosen spaces, then forced content ends the run
        assert not detector.observe([0], [True])
    assert not detector.observe([9], [False])
    assert detector.whitespace_run == 0


def test_chosen_tokens_still_trip_both_checks() -> None:
    limits = WatchdogLimits(stall_whitespace_tokens=4, stall_repeat_tokens=6, max_cycle=2)
    spaces = StallDetector(limits, _is_space)
    assert [spaces.observe([0], [True]) for _ in range(4)] == [False, False, False, True]
    cycle = StallDetector(limits, _is_space)
    # Chosen 5, then forced 6 (ignored): the chosen history 5,5,5,... is a cycle of one.
    tripped = [cycle.observe([5, 6], [True, False]) for _ in range(7)]
    assert tripped == [False] * 6 + [True]
    cycle.reset()
    assert not cycle.observe([5], [True])


def test_a_sampled_token_is_dictated_only_when_every_alternative_spells_the_same() -> None:
    texts = {1: '"', 2: '"em', 3: '"empty"', 4: '"b', 5: "\ufffd", 6: "<|eot_id|>"}
    assert dictated(3, [1, 2, 3], texts.__getitem__)  # any of them starts `"empty"`
    assert dictated(1, [1, 2, 4], texts.__getitem__)  # `"` comes first whatever follows
    assert not dictated(2, [1, 2, 4], texts.__getitem__)  # `"em` over `"b` was a choice
    assert not dictated(3, [3, 6], texts.__getitem__)  # ending was allowed too
    assert not dictated(5, [5], texts.__getitem__)  # part of a character: unknown, so counted
    assert not dictated(3, None, texts.__getitem__)  # a wide mask is a choice


def _few(mask: torch.Tensor, rows: list[int], vocab: int, limit: int) -> dict[int, list[int]]:
    return {row: ids.tolist() for row, ids in unpack_rows(mask, rows, vocab, limit)[1].items()}


def test_narrow_rows_only_are_unpacked() -> None:
    vocab = 200
    mask = allocate_bitmask(3, vocab)
    mask[0] = 0
    mask[0, 1] = 1 << 3  # token 35
    mask[0, 4] = (1 << 31) - (1 << 32) + 1  # tokens 128 and 159 (bit 31 makes the int32 negative)
    mask[1] = 0  # nothing allowed
    found = _few(mask, [0, 1, 2], vocab, limit=4)
    assert found == {0: [35, 128, 159], 1: []}  # row 2 allows everything: not read
    assert _few(mask, [0], vocab, limit=2) == {}
    assert torch.equal(mask[2], torch.full_like(mask[2], -1))
