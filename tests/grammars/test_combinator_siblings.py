"""The keywords beside an anyOf/oneOf move into its branches for xgrammar, which otherwise drops them: the rewrite
must accept exactly what the schema accepts, and leave alone what it cannot move without changing meaning."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from corral.grammar_engines.xgrammar_backend import XGrammarBackend
from corral.grammars.combinator_siblings import distribute_siblings
from corral.grammars.spec import GrammarSpec

SHARED = Path(__file__).resolve().parents[3] / "shared" / "jsonschemabench"

# WashingtonPost/wp_0's shape, small: an object whose oneOf branches only name required keys.
AUDIO = {
    "type": "object",
    "additionalProperties": False,
    "properties": {"type": {"enum": ["audio"]}, "streams": {"type": "array", "items": {"type": "string"}},
                   "source_url": {"type": "string"}},
    "required": ["type"],
    "oneOf": [{"required": ["streams"]}, {"required": ["source_url"]}],
    "definitions": {"unused": {"type": "string"}},
    "title": "Audio",
}
INSTANCES: list[Any] = [
    "a string", 3, None, [], {}, {"type": "audio"}, {"type": "audio", "streams": ["x"]},
    {"type": "audio", "source_url": "u"}, {"type": "audio", "streams": ["x"], "source_url": "u"},
    {"type": "video", "streams": ["x"]}, {"type": "audio", "streams": ["x"], "extra": 1},
    {"type": "audio", "streams": 3},
]


def verdicts(schema: Any, instances: list[Any]) -> list[bool]:
    validator = jsonschema.validators.validator_for(schema)(schema)
    return [validator.is_valid(instance) for instance in instances]


def test_siblings_move_into_every_branch_and_the_meaning_is_kept() -> None:
    rewritten = distribute_siblings(AUDIO)
    assert rewritten is not AUDIO and AUDIO["oneOf"] == [{"required": ["streams"]}, {"required": ["source_url"]}]
    assert set(rewritten) == {"oneOf", "definitions", "title"}  # annotations and definitions stay put
    first = rewritten["oneOf"][0]
    assert first["type"] == "object" and first["additionalProperties"] is False
    assert first["required"] == ["type", "streams"]
    assert verdicts(rewritten, INSTANCES) == verdicts(AUDIO, INSTANCES)
    assert verdicts(AUDIO, INSTANCES).count(True) == 2


def test_nested_nodes_are_rewritten_and_untouched_schemas_come_back_as_they_are() -> None:
    nested = {"type": "object", "properties": {"audio": AUDIO}, "items": [AUDIO], "definitions": {"a": AUDIO}}
    rewritten = distribute_siblings(nested)
    assert "oneOf" in rewritten["properties"]["audio"] and "type" not in rewritten["properties"]["audio"]
    assert "oneOf" in rewritten["definitions"]["a"] and "oneOf" in rewritten["items"][0]
    plain = {"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}
    assert distribute_siblings(plain) is plain  # an anyOf with nothing beside it


@pytest.mark.parametrize(
    ("siblings", "branches"),
    [
        # draft 4-7 ignore the siblings of a $ref: merged into one, they would start to count
        ({"type": "object"}, [{"$ref": "#/definitions/a"}, {"required": ["b"]}]),
        # additionalProperties counts only the properties beside it
        ({"type": "object", "additionalProperties": False}, [{"properties": {"a": {}}}, {"required": ["b"]}]),
        ({"type": "object", "properties": {"a": {}}}, [{"additionalProperties": False}, {}]),
        ({"if": {"required": ["a"]}}, [{"then": {"required": ["b"]}}, {}]),
        ({"type": "object", "properties": {"a": {"type": "string"}}}, [{"properties": {"b": {}}}]),
        ({"type": "string"}, [{"type": "integer"}, {"type": "string"}]),  # a keyword both define, differently
        ({"type": "object", "unevaluatedProperties": False}, [{"required": ["a"]}]),
    ],
)
def test_a_node_whose_siblings_cannot_move_is_kept(siblings: dict[str, Any], branches: list[Any]) -> None:
    schema = {**siblings, "anyOf": branches, "definitions": {"a": {"type": "object"}}}
    assert distribute_siblings(schema) is schema


def test_boolean_branches_and_both_combinators() -> None:
    schema = {"type": "integer", "anyOf": [True, False, {"minimum": 3}]}
    assert distribute_siblings(schema) == {"anyOf": [{"type": "integer"}, False, {"minimum": 3, "type": "integer"}]}
    both = {"type": "object", "anyOf": [{"required": ["a"]}], "oneOf": [{"required": ["b"]}]}
    assert distribute_siblings(both) is both  # which to distribute first is a choice the rewrite does not make


def test_xgrammar_no_longer_lets_the_root_be_any_value(tokenizer: Any) -> None:
    backend = XGrammarBackend(tokenizer)
    compiled = backend.compile(GrammarSpec.json_schema(AUDIO))
    encode = tokenizer.hf_tokenizer.encode

    def accepted(text: str) -> bool:
        tokens = encode(text, add_special_tokens=False)
        return backend.new_matcher(compiled).validate_tokens(tokens) == len(tokens)

    assert not accepted('"a'), "the root may only be an object"
    assert not accepted('{"type": "audio", "extra"')
    assert accepted('{"type": "audio", "streams": ["x"]}')


@pytest.mark.skipif(not SHARED.is_dir(), reason="needs ../shared/jsonschemabench (the full data set) beside the repo")
def test_every_rewritten_jsonschemabench_schema_judges_its_instances_as_before() -> None:
    rewritten = judged = 0
    for path in sorted(SHARED.glob("*/*.json")):
        item = json.loads(path.read_text())
        schema = item["schema"]
        new = distribute_siblings(schema)
        if new is schema:
            continue
        rewritten += 1
        instances = [test["data"] for test in item["tests"]]
        assert verdicts(new, instances) == verdicts(schema, instances), path.name
        judged += len(instances)
    assert rewritten > 200 and judged > 800  # measured: 307 schemas, 1,039 instances
