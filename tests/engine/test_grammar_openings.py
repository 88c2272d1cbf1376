"""The grammar's opening (its shortest answer, the fallback of an answer whose budget barely holds it) is searched
once per grammar, backend, room and schema, not once per request: that search ran on the engine thread at every
admission while the whole batch waited."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import pytest

from corral.grammar_engines.protocol import CompiledGrammar, Matcher, SamplerBackend
from corral.grammars.spec import GrammarSpec
from corral.server.engine.sampling import SamplingParams
from corral.server.engine.sequence import Sequence
from corral.structured import answer_closing, grammar_tokens
from corral.structured.closing import ClosingVocabulary
from corral.structured.grammar_tokens import GrammarTokens

OPENING = [7, 8, 9]


@dataclass(frozen=True)
class _Compiled:
    spec: GrammarSpec
    backend_name: str = "llguidance"


def _sequence(compiled: _Compiled | None, backend: object, keys: frozenset[str] = frozenset()) -> Sequence:
    return Sequence(
        request_id="r", prompt_ids=[1], params=SamplingParams(max_tokens=8), sink=lambda out: None,
        matcher=cast(Matcher, object()), backend=cast(SamplerBackend, backend),
        grammar=cast(CompiledGrammar, compiled), closable=True, required_keys=keys,
    )


@pytest.fixture
def searches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    rooms: list[int] = []

    def search(matcher: Any, vocab: Any, room: int, **kwargs: Any) -> list[int] | None:
        rooms.append(room)
        return list(OPENING)

    monkeypatch.setattr(answer_closing, "shortest_completion", search)
    return rooms


def test_a_grammar_sent_again_reuses_its_opening(searches: list[int]) -> None:
    tokens = GrammarTokens(cast(ClosingVocabulary, None), frozenset(), jump_forward=True)
    backend, other_backend = object(), object()
    schema = _Compiled(GrammarSpec.json_schema({"type": "object", "required": ["a"]}))
    first = tokens.closer_for(_sequence(schema, backend), room=6)
    again = tokens.closer_for(_sequence(_Compiled(schema.spec), backend), room=6)  # recompiled: the same grammar
    assert searches == [6]
    assert first is not None and again is not None and first.fallback == again.fallback == (0, OPENING)
    again.fallback[1].append(0)  # a sequence's fallback is its own: the kept opening does not change
    assert tokens.closer_for(_sequence(schema, backend), room=6).fallback == (0, OPENING)  # type: ignore[union-attr]
    assert searches == [6]
    # Anything that can change the answer searches again: the room, the backend (the contract guard's matcher
    # refuses more), the schema's required keys, another grammar, or a grammar the engine cannot name.
    tokens.closer_for(_sequence(schema, backend), room=5)
    tokens.closer_for(_sequence(schema, other_backend), room=6)
    tokens.closer_for(_sequence(schema, backend, frozenset({"a"})), room=6)
    tokens.closer_for(_sequence(_Compiled(GrammarSpec.json_schema({"type": "array"})), backend), room=6)
    tokens.closer_for(_sequence(_Compiled(schema.spec, "xgrammar"), backend), room=6)
    tokens.closer_for(_sequence(None, backend), room=6)
    assert searches == [6, 5, 6, 6, 6, 6, 6]


def test_no_search_with_room_to_spare_and_misses_are_not_kept(
    searches: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = GrammarTokens(cast(ClosingVocabulary, None), frozenset(), jump_forward=True)
    backend = object()
    schema = _Compiled(GrammarSpec.json_schema({"type": "object"}))
    closer = tokens.closer_for(_sequence(schema, backend), room=answer_closing.FIRST_CHECK + 1)
    assert closer is not None and closer.fallback is None and searches == []
    monkeypatch.setattr(answer_closing, "shortest_completion", lambda *a, **k: searches.append(-1))
    tokens.closer_for(_sequence(schema, backend), room=6)
    tokens.closer_for(_sequence(schema, backend), room=6)
    assert searches == [-1, -1]  # a miss (perhaps the deadline on a busy machine) is searched again


def test_the_kept_openings_are_bounded(searches: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grammar_tokens, "OPENINGS_KEPT", 2)
    tokens = GrammarTokens(cast(ClosingVocabulary, None), frozenset(), jump_forward=True)
    backend = object()
    specs = [_Compiled(GrammarSpec.json_schema({"type": "object", "title": str(i)})) for i in range(3)]
    for compiled in (*specs, specs[2], specs[0]):  # the third pushes the first out
        tokens.closer_for(_sequence(compiled, backend), room=6)
    assert len(searches) == 4
