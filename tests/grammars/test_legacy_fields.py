"""vLLM's older guided_* fields read as the structured_outputs keys they stand for."""

from __future__ import annotations

from typing import Any

import pytest

from corral.grammars.request import parse_constraint
from corral.grammars.spec import GrammarKind, GrammarSpec
from corral.grammars.validation import InvalidConstraint


@pytest.mark.parametrize(("legacy", "structured"), [
    ({"guided_choice": ["a", "b"]}, {"choice": ["a", "b"]}),
    ({"guided_regex": "[0-9]+"}, {"regex": "[0-9]+"}),
    ({"guided_json": {"type": "integer"}}, {"json": {"type": "integer"}}),
    ({"guided_json": '{"type": "integer"}'}, {"json": {"type": "integer"}}),
    ({"guided_grammar": 'start: "x"'}, {"grammar": 'start: "x"'}),
    ({"guided_json_object": True}, {"json_object": True}),
    ({"guided_choice": ["a"], "guided_decoding_backend": "xgrammar"}, {"choice": ["a"], "backend": "xgrammar"}),
])
def test_legacy_field_equals_its_structured_outputs_key(legacy: dict[str, Any], structured: dict[str, Any]) -> None:
    old, new = parse_constraint(None, None, legacy), parse_constraint(None, structured)
    assert (old.spec, old.backend) == (new.spec, new.backend)
    assert old.source == next(k for k in legacy if k != "guided_decoding_backend")


def test_guidance_is_vllms_name_for_llguidance() -> None:
    request = parse_constraint(None, None, {"guided_decoding_backend": "guidance"})
    assert (request.spec, request.backend, request.backend_source) == (None, "llguidance", "guided_decoding_backend")


def test_grammar_kind_is_detected() -> None:
    spec = parse_constraint(None, None, {"guided_grammar": 'root ::= "x"'}).spec
    assert spec == GrammarSpec(GrammarKind.EBNF, 'root ::= "x"')


@pytest.mark.parametrize(("response_format", "structured", "legacy", "param"), [
    ({"type": "json_object"}, None, {"guided_regex": "a"}, "guided_regex"),
    (None, {"choice": ["a"]}, {"guided_json": {}}, "guided_json"),
    (None, None, {"guided_choice": ["a"], "guided_regex": "a"}, "guided_regex"),
    (None, None, {"guided_choice": []}, "guided_choice"),
    (None, None, {"guided_json_object": "yes"}, "guided_json_object"),
    (None, {"backend": "xgrammar"}, {"guided_decoding_backend": "llguidance"}, "guided_decoding_backend"),
])
def test_conflicts_and_bad_values_name_the_legacy_field(response_format: Any, structured: Any,
                                                        legacy: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidConstraint) as info:
        parse_constraint(response_format, structured, legacy)
    assert info.value.param == param
