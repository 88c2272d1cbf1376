"""Request fields → one GrammarSpec (or a precise InvalidConstraint), and post-generation validation."""

from __future__ import annotations

import json
from typing import Any

import pytest

from corral.grammars.contract import validate_output
from corral.grammars.lowering import detect_grammar_kind
from corral.grammars.request import AUTO, parse_constraint
from corral.grammars.spec import GrammarKind, GrammarSpec
from corral.grammars.validation import InvalidConstraint, check_schema, json_pointer

SCHEMA: dict[str, Any] = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def schema_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


# -- parse_constraint: what each field becomes -----------------------------------------------------

def test_no_constraint() -> None:
    request = parse_constraint(None, None)
    assert request.spec is None
    assert request.backend == AUTO


@pytest.mark.parametrize("response_format", [{"type": "text"}, {}])
def test_text_response_format_is_unconstrained(response_format: dict[str, Any]) -> None:
    assert parse_constraint(response_format, None).spec is None


def test_backend_without_constraint_is_kept() -> None:
    request = parse_constraint(None, {"backend": "llguidance"})
    assert request.spec is None
    assert request.backend == "llguidance"


def test_response_format_json_schema() -> None:
    request = parse_constraint(schema_format(SCHEMA), None)
    assert request.spec == GrammarSpec.json_schema(SCHEMA)
    assert request.spec.kind is GrammarKind.JSON_SCHEMA
    assert request.spec.schema() == SCHEMA
    assert request.source == "response_format"


def test_response_format_json_object() -> None:
    request = parse_constraint({"type": "json_object"}, None)
    assert request.spec is not None and request.spec.kind is GrammarKind.JSON_OBJECT
    assert request.spec.schema() == {"type": "object"}


@pytest.mark.parametrize("schema", [SCHEMA, json.dumps(SCHEMA)])
def test_structured_outputs_json_accepts_object_or_string(schema: Any) -> None:
    request = parse_constraint(None, {"json": schema, "backend": "xgrammar"})
    assert request.spec == GrammarSpec.json_schema(SCHEMA)
    assert request.backend == "xgrammar"
    assert request.source == "structured_outputs.json"


def test_cache_key_tells_specs_apart() -> None:
    first = parse_constraint(None, {"json": SCHEMA}).spec
    again = parse_constraint(schema_format(json.loads(json.dumps(SCHEMA))), None).spec
    other = parse_constraint(None, {"json": {**SCHEMA, "required": []}}).spec
    regex = parse_constraint(None, {"regex": "a"}).spec
    assert first is not None and again is not None and other is not None and regex is not None
    assert first.key == again.key
    assert len({first.key, other.key, regex.key, GrammarSpec(GrammarKind.LARK, "a").key}) == 4


def test_choice_keeps_order_and_drops_duplicates() -> None:
    request = parse_constraint(None, {"choice": ["b", "a", "b"]})
    assert request.spec is not None and request.spec.kind is GrammarKind.CHOICE
    assert request.spec.choices() == ["b", "a"]


def test_regex_is_verbatim() -> None:
    request = parse_constraint(None, {"regex": r"\d{3}"})
    assert request.spec == GrammarSpec(GrammarKind.REGEX, r"\d{3}")


@pytest.mark.parametrize(("grammar", "kind"), [
    ('root ::= "a" | "b"\n', GrammarKind.EBNF),
    ('start: "a" | "b"\n', GrammarKind.LARK),
    ('start: item+\nitem: /[a-z]/\n', GrammarKind.LARK),
])
def test_grammar_kind_is_detected(grammar: str, kind: GrammarKind) -> None:
    assert detect_grammar_kind(grammar) is kind
    request = parse_constraint(None, {"grammar": grammar})
    assert request.spec == GrammarSpec(kind, grammar)


@pytest.mark.parametrize(("syntax", "kind"), [
    ("lark", GrammarKind.LARK), ("LARK", GrammarKind.LARK), ("ebnf", GrammarKind.EBNF), ("gbnf", GrammarKind.EBNF),
])
def test_declared_grammar_syntax_wins_over_detection(syntax: str, kind: GrammarKind) -> None:
    request = parse_constraint(None, {"grammar": 'start: "x"\n', "grammar_syntax": syntax})
    assert request.spec is not None and request.spec.kind is kind


def test_lark_grammar_with_bnf_arrow_in_a_literal_is_lark() -> None:
    assert detect_grammar_kind('start: "x ::= " NAME\nNAME: /[a-z]+/\n') is GrammarKind.LARK


# -- parse_constraint: errors name the field and the place -----------------------------------------

def test_exactly_one_constraint_across_fields() -> None:
    with pytest.raises(InvalidConstraint) as info:
        parse_constraint(schema_format(SCHEMA), {"choice": ["a"]})
    assert info.value.param == "structured_outputs.choice"
    assert "exactly one" in str(info.value) and "response_format" in str(info.value)


def test_exactly_one_constraint_inside_structured_outputs() -> None:
    with pytest.raises(InvalidConstraint) as info:
        parse_constraint(None, {"regex": "a", "grammar": 'root ::= "a"'})
    assert info.value.param == "structured_outputs.grammar"
    assert "got 2" in str(info.value)


def test_json_object_response_format_plus_structured_json_object_is_two() -> None:
    with pytest.raises(InvalidConstraint):
        parse_constraint({"type": "json_object"}, {"json_object": True})


def test_false_json_object_is_not_a_constraint() -> None:
    request = parse_constraint(None, {"json_object": False, "choice": ["a"]})
    assert request.spec is not None and request.spec.kind is GrammarKind.CHOICE


def test_invalid_schema_names_the_pointer() -> None:
    with pytest.raises(InvalidConstraint) as info:
        parse_constraint(schema_format({"type": "object", "properties": {"a": {"type": 12}}}), None)
    assert info.value.param == "response_format.json_schema.schema"
    assert info.value.where == "/properties/a/type"
    assert "/properties/a/type" in str(info.value)


@pytest.mark.parametrize(("structured", "param", "words"), [
    ({"choice": []}, "structured_outputs.choice", "empty"),
    ({"choice": "a"}, "structured_outputs.choice", "list of strings"),
    ({"choice": ["a", ""]}, "structured_outputs.choice", "empty string"),
    ({"regex": ""}, "structured_outputs.regex", "non-empty"),
    ({"grammar": "   "}, "structured_outputs.grammar", "non-empty"),
    ({"json_object": "yes"}, "structured_outputs.json_object", "true"),
    ({"json": "{not json"}, "structured_outputs.json", "not valid JSON"),
    ({"json": 5}, "structured_outputs.json", "JSON Schema object"),
    ({"backend": 3}, "structured_outputs.backend", "backend name"),
    ({"grammar": 'start: "a"', "grammar_syntax": "peg"}, "structured_outputs.grammar_syntax", "peg"),
    ({"regexp": "a"}, "structured_outputs", "regexp"),
])
def test_structured_outputs_errors(structured: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(InvalidConstraint) as info:
        parse_constraint(None, structured)
    assert info.value.param == param
    assert words in str(info.value)


@pytest.mark.parametrize(("response_format", "param"), [
    ("json", "response_format"),
    ({"type": "yaml"}, "response_format.type"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
])
def test_response_format_errors(response_format: Any, param: str) -> None:
    with pytest.raises(InvalidConstraint) as info:
        parse_constraint(response_format, None)
    assert info.value.param == param


def test_too_many_choices() -> None:
    with pytest.raises(InvalidConstraint) as info:
        parse_constraint(None, {"choice": [str(i) for i in range(10_001)]})
    assert "10001" in str(info.value)


# -- validation ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("path", "pointer"), [
    ([], "/"), (["properties", "a"], "/properties/a"), (["items", 0], "/items/0"), (["a/b", "c~d"], "/a~1b/c~0d"),
])
def test_json_pointer(path: list[Any], pointer: str) -> None:
    assert json_pointer(path) == pointer


@pytest.mark.parametrize(("schema", "where"), [
    ({"$defs": {"x": {"type": "strin"}}}, "/$defs/x/type"),
    ({"properties": {"a/b": {"minimum": "x"}}}, "/properties/a~1b/minimum"),
    ([1], "/"),
])
def test_check_schema_points_at_the_error(schema: Any, where: str) -> None:
    with pytest.raises(InvalidConstraint) as info:
        check_schema(schema, param="p")
    assert info.value.where == where
    assert info.value.param == "p"


@pytest.mark.parametrize("schema", [True, {}, SCHEMA, {"$schema": "http://json-schema.org/draft-07/schema#",
                                                        "items": [{"type": "string"}]}])
def test_check_schema_accepts_valid_schemas(schema: Any) -> None:
    check_schema(schema, param="p")


def test_validate_output_uses_the_full_schema() -> None:
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer", "maximum": 3}}})
    assert validate_output(spec, '{"a": 2}').valid
    bad = validate_output(spec, '{"a": 7}')
    assert not bad.valid
    assert bad.error is not None and bad.error.startswith("at /a")
    assert not validate_output(spec, '{"a": ').valid


def test_validate_output_checks_formats() -> None:
    spec = GrammarSpec.json_schema({"type": "string", "format": "email"})
    assert validate_output(spec, '"a@b.com"').valid
    assert not validate_output(spec, '"no-at-sign"').valid


def test_validate_output_json_object_requires_an_object() -> None:
    assert validate_output(GrammarSpec.json_object(), '{"k": [1]}').valid
    assert not validate_output(GrammarSpec.json_object(), "[1]").valid


def test_validate_output_choice_and_regex() -> None:
    choice = GrammarSpec.choice(["yes", "no"])
    assert validate_output(choice, "yes").valid
    assert not validate_output(choice, "yes ").valid
    regex = GrammarSpec.regex(r"[0-9]{2}")
    assert validate_output(regex, "42").valid
    assert not validate_output(regex, "421").valid


@pytest.mark.parametrize(
    ("fmt", "good", "bad"),
    [
        ("uri", "https://example.com/a", "not a uri"),
        ("iri", "https://example.com/ä", "not-an-iri"),
        ("date-time", "2024-05-01T12:00:00Z", "2024-05-01 noon"),
        ("hostname", "example.com", "-bad-.host_name"),
        ("json-pointer", "/a/b", "a/b"),
    ],
)
def test_validate_output_checks_formats_that_need_optional_packages(fmt: str, good: str, bad: str) -> None:
    """jsonschema skips these formats silently unless the `format-nongpl` extras are installed
    (pyproject pulls them in); without them the full-contract check would pass anything."""
    spec = GrammarSpec.json_schema({"type": "string", "format": fmt})
    assert validate_output(spec, json.dumps(good)).valid
    assert not validate_output(spec, json.dumps(bad)).valid
