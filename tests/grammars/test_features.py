"""Feature scan and `auto` routing: string length bounds anywhere in a schema go to llguidance first."""

from __future__ import annotations

from typing import Any

import pytest

from grammars.features import route, schema_features
from grammars.spec import GrammarSpec

BOTH = ["xgrammar", "llguidance"]


def bounded(keyword: str = "maxLength") -> dict[str, Any]:
    return {"type": "string", keyword: 4}


@pytest.mark.parametrize("schema", [
    bounded(),
    bounded("minLength"),
    {"type": "object", "properties": {"a": bounded()}},
    {"type": "array", "items": bounded()},
    {"type": "array", "prefixItems": [{"type": "integer"}, bounded()]},
    {"anyOf": [{"type": "integer"}, bounded()]},
    {"type": "object", "additionalProperties": bounded("minLength")},
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/s"}}, "$defs": {"s": bounded()}},
    {"type": "object", "properties": {"a": {"$ref": "#/definitions/s"}}, "definitions": {"s": bounded()}},
    {"type": "object", "patternProperties": {"^x": {"type": "array", "items": bounded()}}},
])
def test_string_length_bounds_route_to_llguidance_first(schema: dict[str, Any]) -> None:
    assert route(GrammarSpec.json_schema(schema), BOTH) == ["llguidance", "xgrammar"]


@pytest.mark.parametrize("schema", [
    {"type": "string"},
    {"type": "array", "maxItems": 3, "minItems": 1},
    {"type": "object", "properties": {"maxLength": {"type": "integer"}}},
])
def test_other_schemas_route_to_llguidance_first_too(schema: dict[str, Any]) -> None:
    # Measured: llguidance is stricter, covers more and compiles faster on JSONSchemaBench (route docstring).
    assert route(GrammarSpec.json_schema(schema), BOTH) == ["llguidance", "xgrammar"]


def test_property_named_like_a_keyword_is_not_a_keyword() -> None:
    assert "maxLength" not in schema_features({"type": "object", "properties": {"maxLength": {"type": "integer"}}})


def test_json_object_routes_to_llguidance_first() -> None:
    assert route(GrammarSpec.json_object(), BOTH) == ["llguidance", "xgrammar"]


@pytest.mark.parametrize("spec", [
    GrammarSpec.choice(["a", "b"]),
    GrammarSpec.regex("[a-z]{1,4}"),
    GrammarSpec.ebnf('root ::= "a"'),
    GrammarSpec.lark('start: "a"'),
])
def test_non_schema_specs_use_the_default_order(spec: GrammarSpec) -> None:
    assert route(spec, BOTH) == ["xgrammar", "llguidance"]


def test_route_lists_only_available_backends_each_once() -> None:
    spec = GrammarSpec.json_schema(bounded())
    assert route(spec, ["xgrammar"]) == ["xgrammar"]
    assert route(spec, ["llguidance"]) == ["llguidance"]
    assert route(spec, ["plugin", "xgrammar", "llguidance"]) == ["llguidance", "xgrammar", "plugin"]
    assert route(GrammarSpec.regex("a"), ["plugin"]) == ["plugin"]
    assert route(GrammarSpec.regex("a"), []) == []


def test_schema_features_reports_formats_and_nested_keywords() -> None:
    schema = {
        "type": "object",
        "properties": {"when": {"type": "string", "format": "date-time"}, "n": {"type": "integer", "minimum": 0}},
        "$defs": {"d": {"type": "array", "uniqueItems": True}},
    }
    features = schema_features(schema)
    assert {"format:date-time", "format", "minimum", "uniqueItems", "properties", "$defs"} <= features
    assert schema_features(True) == frozenset()
