"""`corral bench mediation` pieces that need no server: the derived rules and the per-mode summary."""

from __future__ import annotations

from corral.benchmarks.mediation.rules import derive_rule
from corral.benchmarks.mediation.runner import CallResult, summarize


def test_rules_derive_from_the_first_fitting_property() -> None:
    schema = {"type": "object", "properties": {"kind": {"enum": ["a"]}, "count": {"type": "integer"},
                                               "name": {"type": "string"}}}
    rule = derive_rule(schema)
    assert rule is not None and rule.name == "count_non_negative"
    assert rule.validate({"count": -1}) is not None and rule.validate({"count": 0}) is None
    assert rule.validate({}) is None  # an absent optional field breaks no rule
    assert rule.decode_hint == {"properties": {"count": {"minimum": 0}}}
    text = derive_rule({"properties": {"a/b": {"type": "string"}}})
    assert text is not None and text.validate({"a/b": ""}) is not None and text.path == "/a~1b"
    # Nothing to derive: a rule the schema itself forbids satisfying is not derived either.
    assert derive_rule({"type": "object", "properties": {"n": {"type": "integer", "maximum": -1}}}) is None
    assert derive_rule({"type": "array"}) is None and derive_rule({"$ref": "#/x"}) is None


def _r(mode: str, ok: bool, attempts: int, tokens: int, failure: str | None = None, declared: bool = True
       ) -> CallResult:
    return CallResult("s", mode, declared, ok, attempts, mode, failure, [failure] * attempts, tokens, 0.1)


def test_summary_per_mode() -> None:
    results = [_r("schema_constrained", True, 1, 50), _r("schema_constrained", True, 2, 150),
               _r("json_mode", False, 2, 100, "schema_invalid"), _r("json_mode", True, 1, 60, declared=False)]
    summary = summarize(results)
    sc, jm = summary["schema_constrained"], summary["json_mode"]
    assert (sc["success_rate"], sc["success_within_2"], sc["mean_attempts"], sc["tokens_per_success"]) == (
        1.0, 2, 1.5, 100.0)
    assert jm["success_rate"] == 0.5 and jm["terminal_failures"] == {"schema_invalid": 1}
    assert summarize(results, declared_only=True)["json_mode"]["calls"] == 1
