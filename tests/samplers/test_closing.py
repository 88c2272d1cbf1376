"""The closing search (corral/structured/closing.py): from any point of a valid answer, a short completion the grammar
accepts and, under `auto`'s contract guard, the full schema too. Checked on JSONSchemaBench schemas, cut at
several points of a valid instance, for both tokenizer families."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import SAMPLE_BENCH, TOKENIZER_FAMILIES, family_tokenizer

from corral.grammar_engines.compilation import GrammarCache
from corral.grammar_engines.protocol import Matcher, TokenizerSpec
from corral.grammar_engines.registry import BackendSet
from corral.grammars.contract import validate_output
from corral.grammars.spec import GrammarSpec
from corral.structured.closing import ClosingVocabulary, required_keys, shortest_completion
from corral.structured.json_syntax import JsonScan, json_closing


@pytest.mark.parametrize(
    ("text", "closing"),
    [
        ('{"a": "x', '"}'),
        ('{"a": [1, 2', "]}"),
        ('{"a": {"b": tr', "ue}}"),
        ('{"a": 1.', "1}"),
        ('{"a": 1}', ""),
        ('{"a": {}', "}"),
        ('{"a', '"'),  # a property name: what follows is the schema's to say
        ('{"a": ', ""),  # a value must come first
        ('{"a": 1, ', ""),
        ('"abc', '"'),
        ('<tool_call>\n{"name": "f", "arguments": {"x": "y', '"}}'),
        ('{"a": "q\\"}', '"}'),  # an escaped quote does not end the string
        ("no json here", ""),
    ],
)
def test_json_closing_reads_the_syntax(text: str, closing: str) -> None:
    assert json_closing(text) == closing


def test_distance_ranks_what_closes_sooner_first() -> None:
    at_value = JsonScan().feed('{"a":')
    empty_string, open_string = at_value.copy().feed(' ""'), at_value.copy().feed(' "}')
    assert empty_string.distance() < open_string.distance()  # `"}` opens a string holding a brace
    assert JsonScan().feed('{"a": 1').distance() < JsonScan().feed('{"a": 1,').distance()
    assert JsonScan().feed("<tool_call>").distance() > JsonScan().feed("<tool_call>{").distance()


def _cases(root: Path) -> list[tuple[str, dict[str, Any], Any]]:
    cases = []
    for path in sorted(root.glob("*/*.json")):
        doc = json.loads(path.read_text())
        valid = [t["data"] for t in doc.get("tests", []) if t.get("valid")]
        if valid:
            cases.append((f"{path.parent.name}/{path.name}", doc["schema"], valid[0]))
    return cases


@pytest.fixture(scope="module", params=TOKENIZER_FAMILIES)
def tokenizer(request: pytest.FixtureRequest) -> TokenizerSpec:
    spec = family_tokenizer(str(request.param))
    assert isinstance(spec, TokenizerSpec)
    return spec


_CACHES: dict[int, GrammarCache] = {}  # per tokenizer: its engines' tables take seconds to build


def _matcher_after(tokenizer: TokenizerSpec, spec: GrammarSpec, prefix: str) -> Matcher:
    """A matcher of `spec` under `auto` that has accepted `prefix`."""
    if id(tokenizer) not in _CACHES:
        _CACHES[id(tokenizer)] = GrammarCache(BackendSet(tokenizer))
    cache = _CACHES[id(tokenizer)]
    backends = cache.backends
    compiled = cache.compile(spec, "auto")
    matcher = backends.for_request(compiled.backend, "auto").new_matcher(compiled.compiled)
    assert all(matcher.accept_token(t) for t in tokenizer.hf_tokenizer.encode(prefix, add_special_tokens=False))
    return matcher


def test_cut_answers_close_validly(tokenizer: TokenizerSpec) -> None:
    """Every completion found is valid under the full schema; one is found for nearly every cut."""
    backends = BackendSet(tokenizer)
    cache = GrammarCache(backends)
    vocab = ClosingVocabulary.of(tokenizer)
    hf = tokenizer.hf_tokenizer
    tried, found, invalid = 0, 0, []
    for name, schema, instance in _cases(SAMPLE_BENCH):
        spec = GrammarSpec.json_schema(schema)
        try:
            compiled = cache.compile(spec, "auto")
        except Exception:  # refused schemas are the compile tests' business
            continue
        backend = backends.for_request(compiled.backend, "auto")
        ids = hf.encode(json.dumps(instance), add_special_tokens=False)
        for fraction in (0.3, 0.6, 0.9):
            cut = max(1, int(len(ids) * fraction))
            matcher = backend.new_matcher(compiled.compiled)
            if not all(matcher.accept_token(t) for t in ids[:cut]):
                continue  # the grammar's whitespace style differs from json.dumps' here
            tried += 1
            prefix = hf.decode(ids[:cut])
            plan = shortest_completion(matcher, vocab, 64, prefix=prefix, deadline_s=2.0)  # quality, not time
            if plan is None:
                continue
            found += 1
            answer = prefix + hf.decode(plan)
            if not validate_output(spec, answer).valid:
                invalid.append((name, answer[-120:]))
            # The matcher is back where it was: the completion is accepted from there.
            assert all(matcher.accept_token(t) for t in plan) and matcher.can_terminate()
    assert not invalid, invalid
    assert tried >= 150 and found >= 0.95 * tried, (found, tried)


def test_a_completion_writes_required_properties_not_optional_ones(tokenizer: TokenizerSpec) -> None:
    schema = {
        "type": "object",
        "properties": {"alpha": {"type": "string"}, "beta": {"type": "integer"}, "zeta": {"type": "boolean"}},
        "required": ["zeta"],
        "additionalProperties": False,
    }
    spec = GrammarSpec.json_schema(schema)
    assert required_keys(spec) == {"zeta"}
    assert required_keys(GrammarSpec.json_object()) == frozenset()  # its source is no schema
    matcher = _matcher_after(tokenizer, spec, "{")
    plan = shortest_completion(matcher, ClosingVocabulary.of(tokenizer), 32, prefix="{", keys=required_keys(spec))
    assert plan is not None
    answer = json.loads("{" + tokenizer.hf_tokenizer.decode(plan))
    assert list(answer) == ["zeta"], answer


def test_a_format_string_is_completed_in_its_format(tokenizer: TokenizerSpec) -> None:
    """Where `"` may not come yet (a URI needs its scheme), letters alternate with punctuation until it may."""
    schema = {"type": "object", "properties": {"u": {"type": "string", "format": "uri"}}, "required": ["u"]}
    spec = GrammarSpec.json_schema(schema)
    prefix = '{"u": "'
    matcher = _matcher_after(tokenizer, spec, prefix)
    plan = shortest_completion(matcher, ClosingVocabulary.of(tokenizer), 32, prefix=prefix)
    assert plan is not None
    assert validate_output(spec, prefix + tokenizer.hf_tokenizer.decode(plan)).valid



def test_a_string_closes_without_a_space_the_model_did_not_write(tokenizer: TokenizerSpec) -> None:
    """Inside a string a space is text: the completion ends the string with a bare `"`, not ` "` (Gemma has both
    as one token each, and the spaced one used to win the tie: `"model "`, `"printIn ": ""`)."""
    schema = {"type": "object", "properties": {"note": {"type": "string"}, "id": {"type": "string"}}}
    spec = GrammarSpec.json_schema(schema)
    vocab = ClosingVocabulary.of(tokenizer)
    for prefix in ('{"note": "the model is a model', '{"id": "1234567890', '{"na'):
        matcher = _matcher_after(tokenizer, spec, prefix)
        plan = shortest_completion(matcher, vocab, 32, prefix=prefix, deadline_s=2.0)
        assert plan is not None
        completion = tokenizer.hf_tokenizer.decode(plan)
        assert validate_output(spec, prefix + completion).valid, completion
        assert completion.startswith('"'), completion


def test_a_string_held_open_by_its_pattern_closes_with_text_the_pattern_matches(tokenizer: TokenizerSpec) -> None:
    """Github_hard/o44202: the mask allows nearly every token in a string whose pattern has not matched yet and
    only withholds `"`; the schema's pattern says what is missing (corral/structured/pattern_texts.py)."""
    from corral.structured.pattern_texts import pattern_examples

    schema = {
        "type": "object",
        "properties": {"id": {"type": "string", "pattern": "f-[0-9]+"},
                       "kind": {"type": "string", "pattern": "^srn:type:[a-z]+$"}},
        "required": ["id", "kind"],
    }
    spec = GrammarSpec.json_schema(schema)
    prefix = '{"id": "100000000000'
    matcher = _matcher_after(tokenizer, spec, prefix)
    plan = shortest_completion(matcher, ClosingVocabulary.of(tokenizer), 48, prefix=prefix, keys=required_keys(spec),
                               deadline_s=2.0, examples=pattern_examples(spec))
    assert plan is not None
    answer = prefix + tokenizer.hf_tokenizer.decode(plan)
    assert validate_output(spec, answer).valid, answer
    assert "f-" in json.loads(answer)["id"] and json.loads(answer)["kind"].startswith("srn:type:")
