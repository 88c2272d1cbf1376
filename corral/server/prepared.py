"""A request's way through the serving core, as values: what a front end reads from it (`Admission`), the request
ready for the engine (`Prepared`) and its answer checked (`Finished`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from corral.grammar_engines.compilation import CompileResult
from corral.grammar_engines.protocol import SamplerBackend
from corral.grammars.request import ConstraintRequest
from corral.grammars.spec import JsonWhitespace
from corral.grammars.validation import OutputCheck
from corral.server.engine import SamplingParams, SeqOutput, Sequence
from corral.server.errors import bad_request
from corral.server.settings import Settings
from corral.structured import pattern_examples, required_keys


@dataclass
class Admission:
    """What a front end makes of a request (off the event loop): its prompt's ids, constraint and sampling."""

    prompt_ids: list[int]
    constraint: ConstraintRequest
    params: SamplingParams


def check_prompt_fits(prompt_len: int, limit: int, *, param: str) -> None:
    """A 400 unless the prompt leaves room in the model's context for at least one generated token."""
    if prompt_len >= limit:
        raise bad_request(
            f"the prompt is {prompt_len} tokens; this model's context is {limit} tokens "
            "(prompt + at least one generated token)",
            param=param,
            code="context_length_exceeded",
        )


@dataclass
class Prepared:
    """A validated request, ready for the engine."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    constraint: ConstraintRequest
    compiled: CompileResult | None
    received: float


def json_styled(
    constraint: ConstraintRequest, asked: bool | None, settings: Settings, layout: JsonWhitespace | None = None
) -> ConstraintRequest:
    """The constraint as generation compiles it: whether a JSON answer may start with one space or newline
    (`json_leading_whitespace`, else `--json-leading-whitespace`) and where it may hold whitespace inside
    (`json_whitespace`, else `--json-whitespace`)."""
    if constraint.spec is None:
        return constraint
    lead = settings.json_leading_whitespace if asked is None else asked
    spec = constraint.spec.with_leading_whitespace(lead).with_whitespace(layout or settings.json_whitespace)
    return replace(constraint, spec=spec)


@dataclass
class Finished:
    text: str
    finish_reason: str
    seq: Sequence
    check: OutputCheck | None
    prepared: Prepared
    fallback_from: str | None = None  # the backend whose answer `auto` generated again with another (auto only)


def sequence_for(
    prepared: Prepared, backend: SamplerBackend | None, sink: Callable[[SeqOutput], None], *, streaming: bool,
    close_answers: bool,
) -> Sequence:
    """The engine's sequence for a prepared request: its own matcher of the compiled grammar on `backend`, and
    for an answer the engine may close early, what closing it writes (required keys, pattern examples). JSON
    Schema and tool-call answers close early unless the request, or else the server (`close_answers`), says not."""
    compiled, spec = prepared.compiled, prepared.constraint.spec
    asked = prepared.params.close_answers
    closable = spec is not None and spec.embeds_schema and (close_answers if asked is None else asked)
    grammar = compiled.compiled if backend is not None and compiled is not None else None
    keys: frozenset[str] = frozenset()
    examples: tuple[str, ...] = ()
    if closable and spec is not None:  # what the closing search writes
        keys, examples = required_keys(spec), pattern_examples(spec)
    seq = Sequence(
        request_id=prepared.request_id,
        prompt_ids=prepared.prompt_ids,
        params=prepared.params,
        sink=sink,
        matcher=backend.new_matcher(grammar) if backend is not None and grammar is not None else None,
        backend=backend,
        grammar=grammar,
        streaming=streaming,
        closable=closable,
        required_keys=keys,
        pattern_examples=examples,
    )
    seq.stats.arrival = prepared.received
    return seq
