"""Feature scan and `auto` routing by the traits each backend declares: string length bounds anywhere in a
schema go to llguidance first; a plug-in's traits place it, and keep it away from kinds it does not take."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest

from corral.grammar_engines.backends import llguidance, xgrammar
from corral.grammars import features
from corral.grammars.features import BackendTraits, attempts, schema_features
from corral.grammars.spec import GrammarKind, GrammarSpec

BOTH = ["xgrammar", "llguidance"]
DECLARED = {"xgrammar": xgrammar.TRAITS, "llguidance": llguidance.TRAITS}


def builtin_traits(name: str) -> BackendTraits:
    return DECLARED.get(name, BackendTraits())


# The built-ins' own declarations, handed over as the caller does (corral.grammar_engines.compilation passes
# BackendSet.traits).
route = partial(features.route, traits=builtin_traits)


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
    GrammarSpec.regex("[a-z]{1,4}"),
    GrammarSpec.regex(r"([a-z]{2,6} ){30}[a-z]{2,6}"),
    GrammarSpec.regex(r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
])
def test_regexes_route_to_llguidance_first(spec: GrammarSpec) -> None:
    # Measured (`corral bench kinds`, corral/grammar_engines/backends/llguidance.py): its masks are several times
    # cheaper on
    # wide regexes and as cheap on narrow ones, and its regex dialect is Python's where the two engines differ.
    assert route(spec, BOTH) == ["llguidance", "xgrammar"]
    assert route(spec, ["llguidance", "xgrammar"]) == ["llguidance", "xgrammar"]  # by rank, not enabled order


@pytest.mark.parametrize("regex", [
    "".join(f"[a-z]{{1,{i + 50}}}" for i in range(300)),  # llguidance: compiles, fails ~10 tokens in
    "((x{1000}){1000}){1000}",  # llguidance: 1.3 s in its first mask, then fails
    "a{1000000}",
    "[a-z]{1," + "9" * 5000 + "}",  # more digits than int() reads
])
def test_regexes_with_heavy_counts_route_to_xgrammar_first(regex: str) -> None:
    # llguidance builds their lexer at mask time, where nothing bounds it; xgrammar's compile has a deadline.
    assert llguidance.heavy_counts(GrammarSpec.regex(regex))
    assert route(GrammarSpec.regex(regex), BOTH) == ["xgrammar", "llguidance"]


def test_heavy_counts_looks_at_regexes_and_lark_grammars() -> None:
    # A Lark grammar's terminals go to llguidance when xgrammar yields it (corral/grammars/lark_lexing.py): the same
    # lazily built lexer, the same limit.
    assert llguidance.heavy_counts(GrammarSpec.lark("start: /a{5000}/"))
    assert route(GrammarSpec.lark("start: /[a-z]{1,5000}/"), BOTH)[0] == "xgrammar"
    assert not llguidance.heavy_counts(GrammarSpec.ebnf("root ::= [a-z]{1,5000}"))  # xgrammar's kind anyway
    assert not llguidance.heavy_counts(GrammarSpec.regex("[a-z]{1,500}[0-9]{1,500}"))  # 1,000: not past it


def test_an_unanchored_counted_property_name_pattern_routes_to_xgrammar_first() -> None:
    # Github_trivial/o78117: llguidance compiled it and failed two tokens into the first key at mask time.
    wide = {"patternProperties": {"[A-Za-z0-9-_.:]{1,255}": {"type": "string", "format": "uri"}}}
    assert llguidance.heavy_counts(GrammarSpec.json_schema(wide))
    assert route(GrammarSpec.json_schema(wide), BOTH) == ["xgrammar", "llguidance"]
    nested = {"type": "object", "properties": {"m": wide}}
    assert route(GrammarSpec.tool_calls({"tools": [{"name": "f", "parameters": nested}]}), BOTH)[0] == "xgrammar"
    for held in ({"patternProperties": {"^[A-Za-z0-9-_.:]{1,2000}$": {}}},  # anchored: measured to hold
                 {"patternProperties": {"[a-z]{1,64}": {}}},
                 {"properties": {"x": {"type": "string", "pattern": "[a-z]{1,255}"}}}):  # a value, not a name
        assert route(GrammarSpec.json_schema(held), BOTH) == ["llguidance", "xgrammar"], held


def test_a_yielded_spec_still_goes_before_unranked_backends() -> None:
    spec = GrammarSpec.regex("a{5000}")
    assert route(spec, ["plugin", "llguidance"]) == ["llguidance", "plugin"]


@pytest.mark.parametrize("spec", [
    GrammarSpec.choice(["a", "b"]),
    GrammarSpec.ebnf('root ::= "a"'),
    GrammarSpec.lark('start: "a"'),
])
def test_grammars_and_choices_route_to_xgrammar_first(spec: GrammarSpec) -> None:
    # Grammars: llguidance lexes terminals greedily, which changes (and can hang on) some grammars' languages;
    # choices: xgrammar's masks measured cheaper (corral/grammar_engines/backends/xgrammar.py).
    assert route(spec, BOTH) == ["xgrammar", "llguidance"]
    assert route(spec, ["llguidance", "xgrammar"]) == ["xgrammar", "llguidance"]


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


CHOOSER = BackendTraits(kinds=frozenset({GrammarKind.CHOICE}), rank={GrammarKind.CHOICE: 0})


def with_chooser(name: str) -> BackendTraits:
    return CHOOSER if name == "chooser" else builtin_traits(name)


def test_a_plugins_rank_puts_it_first_for_the_kinds_it_ranks() -> None:
    assert features.route(GrammarSpec.choice(["a"]), [*BOTH, "chooser"], with_chooser) == ["chooser", *BOTH]


def test_a_backend_is_not_routed_a_kind_it_does_not_take() -> None:
    spec = GrammarSpec.ebnf('root ::= "a"')
    assert features.route(spec, ["chooser", *BOTH], with_chooser) == BOTH
    assert features.route(GrammarSpec.regex("a"), ["chooser", *BOTH], with_chooser) == ["llguidance", "xgrammar"]
    assert features.route(spec, ["chooser"], with_chooser) == []


def test_the_decode_safe_profile_is_tried_only_by_backends_that_declare_one() -> None:
    spec = GrammarSpec.json_schema({"type": "object"})
    plan = [(name, s.decode_safe) for name, s in attempts(spec, ["plugin", "llguidance"], builtin_traits)]
    assert plan == [("llguidance", False), ("llguidance", True), ("plugin", False)]


def test_without_a_lookup_every_backend_is_neutral(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(features, "_installed", [features._neutral])
    assert features.route(GrammarSpec.json_object(), BOTH) == BOTH


def test_the_registry_installs_its_lookup() -> None:
    from corral.grammar_engines import registry

    assert features.traits_of("llguidance") is registry.backend_traits("llguidance") is llguidance.TRAITS
    assert features.route(GrammarSpec.json_object(), BOTH) == ["llguidance", "xgrammar"]
    assert features.traits_of("no-such-backend") == BackendTraits()
