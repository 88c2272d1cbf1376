"""Mediator[T]: one call that returns a typed, validated Mediated[T] or raises a MediationError.

The round logic is one generator (`_session`): it yields the request for each round and receives the provider's
answer (or the exception it raised), so the sync and async drivers below share every decision."""

from __future__ import annotations

import json
import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

import openai

from corral.mediation.failures import Failure, FailureClass, MediationError
from corral.mediation.judging import AnswerCheck, Outcome, Usage
from corral.mediation.markers import BEGIN, END, lark_grammar
from corral.mediation.modes import PLAIN, Capabilities, Mode, choose_mode, degrade, fetch_corral_capabilities
from corral.mediation.repair import Escalation, RepairPolicy, repair_message
from corral.mediation.schemas import OutputSchema
from corral.mediation.telemetry import RoundRecord, Sink
from corral.mediation.validators import SemanticValidator, decode_hint

T = TypeVar("T")

# Decode-time profile of a schema inside a Lark `%json` grammar (llguidance options): keywords the engine
# cannot enforce are skipped and oneOf is compiled as anyOf, because the full schema is checked afterwards
# here. No free whitespace (a model can loop on it), the usual separators.
DECODE_SAFE_JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": True,
    "coerce_one_of": True,
}


@dataclass(frozen=True)
class Mediated(Generic[T]):
    """A validated value and how it was obtained. Only this is meant to travel downstream."""

    value: T
    attempts: int
    mode: Mode
    schema_version: str
    usage: Usage  # summed over every round
    confidence: float | None  # geometric-mean token probability of the accepted answer, when logprobs came
    provider: str
    model: str
    raw: str  # the accepted answer's text ("" when a reviewer supplied the value)
    reviewed: bool = False  # the value came from the human-review hook, not the model


class Mediator(Generic[T]):
    """Typed LLM calls against any OpenAI-compatible endpoint.

    Tier 1: the mode (from `capabilities`) decides what the provider decodes under. Tier 2: every answer is
    checked in full — markers (when `markers`), JSON, the full schema (any accepted version), the typed
    parse, then each SemanticValidator. Tier 3: `repair` decides on another round; the failures go into it
    as a user turn, and validators with a `decode_hint` tighten the constraint for it."""

    def __init__(
        self,
        output: OutputSchema[T],
        *,
        model: str,
        client: openai.OpenAI | None = None,
        async_client: openai.AsyncOpenAI | None = None,
        capabilities: Capabilities = PLAIN,
        provider: str = "openai-compatible",
        mode: Mode = Mode.SCHEMA_CONSTRAINED,
        markers: bool = False,
        validators: Sequence[SemanticValidator[T]] = (),
        repair: RepairPolicy | None = None,
        sink: Sink | None = None,
        logprobs: bool = True,
    ) -> None:
        if client is None and async_client is None:
            raise ValueError("give a client (openai.OpenAI) or an async_client (openai.AsyncOpenAI)")
        self.output = output
        self.model = model
        self.client = client
        self.async_client = async_client
        self.capabilities = capabilities
        self.provider = provider
        self.preferred = Mode(mode)
        self.markers = markers
        self.validators = list(validators)
        self.repair = repair or RepairPolicy()
        self.sink = sink
        self.logprobs = logprobs and capabilities.logprobs
        self._check = AnswerCheck(output, self.validators, markers)

    @classmethod
    def for_corral(cls, output: OutputSchema[T], *, client: openai.OpenAI, model: str, **kwargs: Any) -> Mediator[T]:
        """A mediator whose capabilities are what the corral at `client.base_url` advertises."""
        capabilities = fetch_corral_capabilities(str(client.base_url), api_key=client.api_key or None)
        return cls(output, model=model, client=client, capabilities=capabilities, provider="corral", **kwargs)

    @property
    def mode(self) -> Mode:
        """The mode the first round uses with this provider."""
        return choose_mode(self.capabilities, markers=self.markers, preferred=self.preferred)

    # -- drivers ---------------------------------------------------------------------------------------------
    def call(self, messages: str | list[dict[str, Any]], **options: Any) -> Mediated[T]:
        """One mediated call; `options` are chat-completion fields (temperature, max_tokens, seed, ...)."""
        if self.client is None:
            raise ValueError("this Mediator has no sync client; use acall or pass client=")
        session = self._session(_as_messages(messages), options)
        request = next(session)
        while True:
            try:
                answer: Any = self.client.chat.completions.create(**request)
            except openai.APIError as exc:
                answer = exc
            try:
                request = session.send(answer)
            except StopIteration as done:
                result: Mediated[T] = done.value
                return result

    async def acall(self, messages: str | list[dict[str, Any]], **options: Any) -> Mediated[T]:
        if self.async_client is None:
            raise ValueError("this Mediator has no async client; use call or pass async_client=")
        session = self._session(_as_messages(messages), options)
        request = next(session)
        while True:
            try:
                answer: Any = await self.async_client.chat.completions.create(**request)
            except openai.APIError as exc:
                answer = exc
            try:
                request = session.send(answer)
            except StopIteration as done:
                result: Mediated[T] = done.value
                return result

    # -- the rounds ------------------------------------------------------------------------------------------
    def _session(
        self, messages: list[dict[str, Any]], options: dict[str, Any]
    ) -> Generator[dict[str, Any], Any, Mediated[T]]:
        mode = self.mode
        conversation = self._opening(messages, mode)
        failures: list[Failure] = []
        hints: list[dict[str, Any]] = []
        usage = Usage()
        last_raw: str | None = None
        for attempt in range(1, self.repair.max_attempts + 1):
            request = self._request(conversation, mode, hints, options)
            started = time.perf_counter()
            answer = yield request
            outcome = self._check.judge(answer)
            usage += outcome.usage
            self._record(request, mode, attempt, outcome, (time.perf_counter() - started) * 1000)
            if not outcome.failures and outcome.version is not None:
                return Mediated(cast(T, outcome.value), attempt, mode, outcome.version, usage, outcome.confidence,
                                self.provider, self.model, outcome.raw or "")
            first = outcome.failures[0]
            failures.append(first)
            last_raw = outcome.raw if outcome.raw is not None else last_raw
            if not self.repair.next_round(failures):
                break
            if first.cls is FailureClass.MODE_UNSUPPORTED:
                lower = degrade(mode, self.capabilities, markers=self.markers)
                if lower is None:
                    break
                mode, conversation = lower, self._opening(messages, lower)
                continue
            if outcome.raw is not None:
                turn = repair_message(outcome.failures, markers=self.markers)
                conversation = [*conversation, {"role": "assistant", "content": outcome.raw},
                                {"role": "user", "content": turn}]
            hints += [h for h in self._hints(outcome.failures) if h not in hints]
        return self._exhausted(messages, failures, last_raw, mode, usage)

    def _exhausted(self, messages: list[dict[str, Any]], failures: list[Failure], last_raw: str | None,
                   mode: Mode, usage: Usage) -> Mediated[T]:
        last = failures[-1]
        hook = self.repair.escalate
        if hook is None or last.cls not in self.repair.repairable:
            raise MediationError(last, attempts=len(failures), failures=failures)
        reviewed = hook(Escalation(self.output.name, messages, last_raw, list(failures)))
        if reviewed is None:
            raise MediationError(last, attempts=len(failures), failures=failures, escalated=True)
        outcome: Outcome[T] = Outcome()
        self._check.check_value(reviewed, outcome)
        if outcome.failures or outcome.version is None:
            failure = outcome.failures[0]
            raise MediationError(failure, attempts=len(failures), failures=[*failures, failure], escalated=True)
        return Mediated(cast(T, outcome.value), len(failures), mode, outcome.version, usage, None,
                        self.provider, self.model, "", reviewed=True)

    def _hints(self, failures: list[Failure]) -> list[dict[str, Any]]:
        names = {f.validator for f in failures if f.cls is FailureClass.SEMANTIC_INVALID}
        return [h for v in self.validators if v.name in names and (h := decode_hint(v)) is not None]

    # -- tier 1: what to send --------------------------------------------------------------------------------
    def _opening(self, messages: list[dict[str, Any]], mode: Mode) -> list[dict[str, Any]]:
        """The caller's messages behind one system message stating the contract. Under schema_constrained
        the provider holds the shape, so the schema itself is not spelled out (tokens)."""
        if mode is Mode.SCHEMA_CONSTRAINED:
            what = f"Answer with a JSON value for `{self.output.name}`."
        else:
            what = (f"Answer with a JSON value for `{self.output.name}` that satisfies this JSON Schema:\n"
                    f"{json.dumps(self.output.schema, ensure_ascii=False)}")
        if self.markers:
            what += (f"\nWrite it as exactly one block and nothing else:\n{BEGIN}\n<the JSON>\n{END}")
        else:
            what += "\nWrite only the JSON, nothing before or after it."
        return [{"role": "system", "content": what}, *messages]

    def _request(self, conversation: list[dict[str, Any]], mode: Mode, hints: list[dict[str, Any]],
                 options: dict[str, Any]) -> dict[str, Any]:
        request: dict[str, Any] = {**options, "model": self.model, "messages": conversation}
        if self.logprobs:
            request["logprobs"] = True
        schema = self.output.schema
        if hints:  # merged at the root, so a schema's own "#/$defs/..." references still resolve
            schema = {**schema, "allOf": [*schema.get("allOf", []), *hints]}
        extra: dict[str, Any] = dict(request.pop("extra_body", None) or {})
        if mode is Mode.SCHEMA_CONSTRAINED and not self.markers:
            request["response_format"] = {
                "type": "json_schema", "json_schema": {"name": _schema_name(self.output.name), "schema": schema}}
        elif mode is Mode.JSON_MODE and not self.markers:
            request["response_format"] = {"type": "json_object"}
        elif mode is not Mode.CONTRACT_ONLY:  # markers: only a grammar can carry them
            decode = schema if mode is Mode.SCHEMA_CONSTRAINED else {"type": "object"}
            grammar = lark_grammar(decode, DECODE_SAFE_JSON_OPTIONS)
            block: dict[str, Any] = {"grammar": grammar, "grammar_syntax": "lark"}
            if self.capabilities.grammar_backend:
                block["backend"] = self.capabilities.grammar_backend
            extra["structured_outputs"] = block
        if extra:
            request["extra_body"] = extra
        return request

    def _record(self, request: dict[str, Any], mode: Mode, attempt: int, outcome: Outcome[T],
                latency_ms: float) -> None:
        if self.sink is None:
            return
        self.sink.record(RoundRecord(
            provider=self.provider, model=self.model, mode=str(mode), schema_name=self.output.name,
            schema_version=outcome.version, attempt=attempt,
            failure_class=str(outcome.failures[0].cls) if outcome.failures else None,
            finish_reason=outcome.finish_reason, prompt_tokens=outcome.usage.prompt_tokens,
            completion_tokens=outcome.usage.completion_tokens, latency_ms=round(latency_ms, 3),
            checks=dict(outcome.checks), messages=list(request["messages"]), output=outcome.raw,
        ))


def _as_messages(messages: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": messages}] if isinstance(messages, str) else list(messages)


def _schema_name(name: str) -> str:
    """OpenAI's json_schema.name: letters, digits, _ and -, 64 at most."""
    cleaned = "".join(c if c.isalnum() or c in "_-" else "_" for c in name)[:64]
    return cleaned or "result"
