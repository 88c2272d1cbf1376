"""Mediation against a live corral (the shared server fixture, embedded default model): every failure class
provoked for real, the repair loop, escalation, and one integration path per mode. What went over the wire is
read from an httpx event hook on the SDK's own client, not from the mediator's account of itself."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest
from pydantic import BaseModel

from corral.mediation import (
    BEGIN,
    END,
    Escalation,
    FailureClass,
    MediationError,
    Mediator,
    MemorySink,
    Mode,
    OutputSchema,
    RepairPolicy,
    Rule,
)
from corral.mediation.modes import fetch_corral_capabilities

MODEL = "corral-tiny"
PROMPT = "A person"
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 120}


class Person(BaseModel):
    name: str
    age: int


class Wire:
    """Request bodies of /chat/completions as the SDK sent them."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> None:
        if request.url.path.endswith("/chat/completions"):
            self.bodies.append(json.loads(request.content))


def _client(server: Any, wire: Wire) -> openai.OpenAI:
    http = httpx.Client(event_hooks={"request": [wire]})
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, http_client=http)


def _mediator(server: Any, wire: Wire, output: OutputSchema[Any] | None = None, **kwargs: Any) -> Mediator[Any]:
    return Mediator.for_corral(output or OutputSchema.from_model(Person), client=_client(server, wire), model=MODEL,
                               **kwargs)


def test_corral_advertises_what_mediation_needs(server: Any) -> None:
    caps = fetch_corral_capabilities(f"{server.base_url}/v1")
    assert caps.json_schema and caps.json_object and caps.lark_json and caps.logprobs
    assert caps.grammar_backend == "llguidance"


def test_schema_constrained_markers_are_in_the_grammar(server: Any) -> None:
    wire, sink = Wire(), MemorySink()
    result = _mediator(server, wire, markers=True, sink=sink).call(PROMPT, **GREEDY)
    assert result.mode is Mode.SCHEMA_CONSTRAINED and result.attempts == 1
    assert isinstance(result.value, Person) and result.schema_version == "v1"
    assert result.raw.startswith(BEGIN) and result.raw.rstrip().endswith(END)
    block = wire.bodies[0]["structured_outputs"]
    assert block["grammar_syntax"] == "lark" and BEGIN in block["grammar"] and "%json" in block["grammar"]
    assert "response_format" not in wire.bodies[0]
    assert result.confidence is not None and 0 < result.confidence <= 1  # from the logprobs corral returned
    assert result.usage.completion_tokens > 0 and sink.rounds[0].checks == {
        "markers": True, "json": True, "schema": True}


def test_schema_constrained_without_markers_uses_response_format_async(server: Any) -> None:
    wire = Wire()
    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                                http_client=httpx.AsyncClient(event_hooks={"request": [_async(wire)]}))
    caps = fetch_corral_capabilities(f"{server.base_url}/v1")
    mediator = Mediator(OutputSchema.from_model(Person), model=MODEL, async_client=client, capabilities=caps)
    result = asyncio.run(mediator.acall(PROMPT, **GREEDY))
    assert isinstance(result.value, Person) and result.mode is Mode.SCHEMA_CONSTRAINED
    assert wire.bodies[0]["response_format"]["type"] == "json_schema"


def _async(wire: Wire) -> Any:
    async def hook(request: httpx.Request) -> None:
        wire(request)

    return hook


def test_json_mode_succeeds_where_the_object_is_enough(server: Any) -> None:
    wire = Wire()
    notes = OutputSchema.from_json_schema({"type": "object", "properties": {"note": {"type": "string"}}},
                                          name="notes")
    result = _mediator(server, wire, notes, mode=Mode.JSON_MODE).call(PROMPT, **GREEDY)
    assert result.mode is Mode.JSON_MODE and isinstance(result.value, dict)
    assert wire.bodies[0]["response_format"] == {"type": "json_object"}
    assert "JSON Schema" in wire.bodies[0]["messages"][0]["content"]  # json_mode spells the schema out


def test_json_mode_schema_invalid(server: Any) -> None:
    # The model's JSON object is `{}`: JSON mode guarantees the object, not the shape.
    with pytest.raises(MediationError) as caught:
        _mediator(server, Wire(), mode=Mode.JSON_MODE, repair=RepairPolicy(structural_retries=0)).call(
            PROMPT, **GREEDY)
    assert caught.value.failure_class is FailureClass.SCHEMA_INVALID and caught.value.attempts == 1
    assert "required" in caught.value.failure.message and caught.value.failure.finish_reason == "stop"


def test_contract_only_marker_missing_then_one_retry_then_terminal(server: Any) -> None:
    wire, sink = Wire(), MemorySink()
    with pytest.raises(MediationError) as caught:
        _mediator(server, wire, mode=Mode.CONTRACT_ONLY, markers=True, sink=sink).call(PROMPT, **GREEDY)
    assert caught.value.failure_class is FailureClass.MARKER_MISSING
    assert caught.value.attempts == 2  # structural: a single retry, then terminal (seed 003)
    assert all("response_format" not in b and "structured_outputs" not in b for b in wire.bodies)
    assert BEGIN in wire.bodies[0]["messages"][0]["content"]  # the contract is in the instructions
    assert "marker_missing" in wire.bodies[1]["messages"][-1]["content"]  # and the failure in the retry
    assert [r.failure_class for r in sink.rounds] == ["marker_missing", "marker_missing"]


def test_contract_only_json_parse_failed(server: Any) -> None:
    with pytest.raises(MediationError) as caught:
        _mediator(server, Wire(), mode=Mode.CONTRACT_ONLY, repair=RepairPolicy(structural_retries=0)).call(
            PROMPT, **GREEDY)
    assert caught.value.failure_class is FailureClass.JSON_PARSE_FAILED


def test_truncated_carries_corrals_finish_reason(server: Any) -> None:
    with pytest.raises(MediationError) as caught:
        _mediator(server, Wire(), repair=RepairPolicy(structural_retries=0)).call(PROMPT, temperature=0,
                                                                                   max_tokens=3)
    assert caught.value.failure_class is FailureClass.TRUNCATED
    assert caught.value.failure.finish_reason == "length"


def test_mode_unsupported_degrades_to_the_next_mode(server: Any) -> None:
    # Look-behind in a pattern: no engine compiles it, corral answers 400 unsupported_schema.
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=a)b"}}}
    wire, sink = Wire(), MemorySink()
    result = _mediator(server, wire, OutputSchema.from_json_schema(schema), sink=sink).call(PROMPT, **GREEDY)
    assert [r.failure_class for r in sink.rounds] == ["mode_unsupported", None]
    assert [r.mode for r in sink.rounds] == ["schema_constrained", "json_mode"]
    assert result.mode is Mode.JSON_MODE and result.attempts == 2
    assert wire.bodies[1]["response_format"] == {"type": "json_object"}


def test_provider_error(server: Any) -> None:
    mediator = _mediator(server, Wire())
    mediator.model = "no-such-model"  # corral answers 404 model_not_found
    with pytest.raises(MediationError) as caught:
        mediator.call(PROMPT, **GREEDY)
    assert caught.value.failure_class is FailureClass.PROVIDER_ERROR and caught.value.attempts == 1


ADULT = Rule("adult", lambda p: p.age >= 18, "age must be at least 18", path="/age",
             decode_hint={"properties": {"age": {"minimum": 18}}})


def test_repair_turns_a_semantic_failure_into_success(server: Any) -> None:
    wire, sink = Wire(), MemorySink()
    result = _mediator(server, wire, validators=[ADULT], sink=sink).call(PROMPT, **GREEDY)
    assert [r.failure_class for r in sink.rounds] == ["semantic_invalid", None]
    assert result.attempts == 2 and result.value.age >= 18
    first, second = wire.bodies
    rejected = json.loads(sink.rounds[0].output or "")
    assert rejected["age"] < 18
    # The second prompt carries the rejected answer and the validator's error...
    assert second["messages"][-2] == {"role": "assistant", "content": sink.rounds[0].output}
    assert "[semantic_invalid (adult)] at /age age must be at least 18" in second["messages"][-1]["content"]
    # ...and the rule, said as JSON Schema, now constrains decoding too.
    assert second["response_format"]["json_schema"]["schema"]["allOf"] == [{"properties": {"age": {"minimum": 18}}}]
    assert "allOf" not in first["response_format"]["json_schema"]["schema"]
    assert sink.rounds[0].checks == {"json": True, "schema": True, "adult": False}
    assert result.usage.total_tokens == sum(r.prompt_tokens + r.completion_tokens for r in sink.rounds)


IMPOSSIBLE = Rule("known_name", lambda p: p.name == "Ada Lovelace", "name must be a known person", path="/name")


def test_escalation_after_the_budget(server: Any) -> None:
    cases: list[Escalation] = []

    def review(case: Escalation) -> Any:
        cases.append(case)
        return {"name": "Ada Lovelace", "age": 36}

    result = _mediator(server, Wire(), validators=[IMPOSSIBLE],
                       repair=RepairPolicy(max_attempts=2, escalate=review)).call(PROMPT, **GREEDY)
    assert result.reviewed and result.value == Person(name="Ada Lovelace", age=36) and result.attempts == 2
    assert len(cases) == 1 and [f.cls for f in cases[0].failures] == [FailureClass.SEMANTIC_INVALID] * 2
    assert cases[0].messages == [{"role": "user", "content": PROMPT}] and cases[0].last_output


def test_escalation_declined_raises_escalated(server: Any) -> None:
    with pytest.raises(MediationError) as caught:
        _mediator(server, Wire(), validators=[IMPOSSIBLE],
                  repair=RepairPolicy(max_attempts=2, escalate=lambda case: None)).call(PROMPT, **GREEDY)
    assert caught.value.escalated and caught.value.failure_class is FailureClass.SEMANTIC_INVALID


def test_dynamic_enum(server: Any) -> None:
    agents = ["planner", "coder", "reviewer"]  # live data, per call
    result = _mediator(server, Wire(), OutputSchema.dynamic_enum(agents), markers=True).call(
        "Who should take this task?", **GREEDY)
    assert result.value in agents


def test_grammars_endpoint_compiles_without_generating(server: Any) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer", "not": {"const": 3}}}, "required": ["a"]}
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    first = httpx.post(f"{server.base_url}/v1/grammars", json=body, timeout=60).json()
    assert first["kind"] == "json_schema" and first["backend"] == "llguidance" and first["profile"] == "decode_safe"
    assert first["keywords"] == {"decode": ["properties", "required", "type"], "post_check": ["const", "not"]}
    assert first["compile_ms"] >= 0
    again = httpx.post(f"{server.base_url}/v1/grammars", json=body, timeout=60).json()
    assert again["cache_hit"] and again["key"] == first["key"]


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format.json_schema.schema", None),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.regex", None),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "string", "pattern": "(?<=a)b"}}}}, "response_format", "unsupported_schema"),
        ({"tool_choice": "required"}, "tool_choice", None),
        ({}, "response_format", None),
    ],
)
def test_grammars_endpoint_answers_the_generation_400(server: Any, body: dict[str, Any], param: str,
                                                      code: str | None) -> None:
    answer = httpx.post(f"{server.base_url}/v1/grammars", json=body, timeout=60)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == param and error["code"] == code
    if body:  # the same 400 a chat request with these fields gets
        chat = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60,
                          json={**body, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
        assert chat.status_code == 400 and chat.json()["error"] == error
