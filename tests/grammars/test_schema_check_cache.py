"""A schema that passed the meta-schema check is not checked again; a bad one is refused every time."""

from __future__ import annotations

import pytest

from corral.grammars import validation
from corral.grammars.validation import InvalidConstraint, check_schema


def test_a_schema_seen_before_skips_the_meta_schema_check(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[object] = []
    real = validation._check_schema_uncached

    def counting(schema: dict[str, object] | bool, param: str) -> None:
        calls.append(schema)
        real(schema, param)

    monkeypatch.setattr(validation, "_check_schema_uncached", counting)
    schema = {"type": "object", "properties": {"cache_probe_a": {"type": "integer", "minimum": 3}}}
    check_schema(schema, param="response_format.json_schema.schema")
    check_schema(dict(schema), param="structured_outputs.json")  # equal text, another request
    assert len(calls) == 1
    check_schema({"properties": {"cache_probe_a": {"minimum": 3, "type": "integer"}}, "type": "object"}, param="p")
    assert len(calls) == 2, "key order is part of the canonical text (engines keep it): another entry"


@pytest.mark.parametrize("param", ["structured_outputs.json", "tools[0].function.parameters"])
def test_an_invalid_schema_is_refused_each_time_naming_that_requests_field(param: str) -> None:
    bad = {"type": "object", "properties": {"cache_probe_b": {"type": "integr"}}}
    for _ in range(2):
        with pytest.raises(InvalidConstraint) as info:
            check_schema(bad, param=param)
        assert info.value.param == param and info.value.where == "/properties/cache_probe_b/type"


def test_the_cache_forgets_the_least_recently_used() -> None:
    passed = validation._PassedSchemas(2)
    passed.add(b"a")
    passed.add(b"b")
    assert passed.seen(b"a")  # now b is the oldest
    passed.add(b"c")
    assert passed.seen(b"a") and passed.seen(b"c") and not passed.seen(b"b")
