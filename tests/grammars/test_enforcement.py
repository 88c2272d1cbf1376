"""The keyword report (`POST /v1/grammars`): each backend's own table says what its compile enforces while
decoding; a backend that declares no table claims nothing."""

from __future__ import annotations

from typing import Any

from corral.grammar_engines.backends import llguidance, xgrammar
from corral.grammars.enforcement import keyword_enforcement
from corral.grammars.features import BackendTraits, KeywordTable
from corral.grammars.spec import GrammarSpec

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "not": {"const": 3}},
        "o": {"oneOf": [{"type": "integer"}, {"type": "string"}]},
        "d": {"type": "string", "format": "date"},
    },
}
FULL = GrammarSpec.json_schema(SCHEMA)


def declared(name: str) -> BackendTraits:
    return {"xgrammar": xgrammar.TRAITS, "llguidance": llguidance.TRAITS}.get(name, BackendTraits())


def test_builtin_tables_by_profile() -> None:
    assert keyword_enforcement(FULL, "llguidance", declared) == {
        "decode": ["const", "format:date", "not", "oneOf", "properties", "type"], "post_check": []}
    # The lenient profile skips `not` (and the `const` only reachable beneath it) and relaxes oneOf.
    assert keyword_enforcement(FULL.relaxed(), "llguidance", declared) == {
        "decode": ["format:date", "properties", "type"], "post_check": ["const", "not", "oneOf"]}
    assert keyword_enforcement(FULL, "xgrammar", declared) == {
        "decode": ["const", "not", "properties", "type"], "post_check": ["format:date", "oneOf"]}
    assert keyword_enforcement(FULL.relaxed(), "xgrammar", declared) == {
        "decode": ["properties", "type"], "post_check": ["const", "format:date", "not", "oneOf"]}


def test_a_plugins_table_is_read_like_a_builtins() -> None:
    strict = BackendTraits(keywords=KeywordTable(formats=frozenset({"date"})))
    assert keyword_enforcement(FULL, "plugin", lambda _: strict) == {
        "decode": ["const", "format:date", "not", "oneOf", "properties", "type"], "post_check": []}


def test_a_backend_without_a_table_claims_nothing() -> None:
    assert keyword_enforcement(FULL, "plugin", declared) == {
        "decode": [], "post_check": ["const", "format:date", "not", "oneOf", "properties", "type"]}


def test_grammars_regexes_and_choices_have_no_report() -> None:
    assert keyword_enforcement(GrammarSpec.regex("a+"), "plugin", declared) is None
    assert keyword_enforcement(GrammarSpec.choice(["a"]), "xgrammar", declared) is None
