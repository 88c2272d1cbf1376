"""A `$ref` must resolve inside the schema document: corral never fetches one."""

from __future__ import annotations

import pytest

from corral.grammars.validation import InvalidConstraint, check_schema


@pytest.mark.parametrize("ref", ["http://127.0.0.1:9/never.json", "other.json#/$defs/a", "file:///etc/passwd"])
def test_a_reference_outside_the_document_is_refused_with_its_code(ref: str) -> None:
    with pytest.raises(InvalidConstraint) as info:
        check_schema({"type": "object", "properties": {"a": {"$ref": ref}}}, param="structured_outputs.json")
    assert info.value.code == "unresolvable_ref" and info.value.param == "structured_outputs.json"
    assert ref in str(info.value)


def test_references_to_ids_inside_the_document_are_kept() -> None:
    schema = {
        "$id": "https://example.com/root.json",
        "$defs": {"item": {"$id": "item.json", "type": "integer"}},
        "type": "array",
        "items": {"$ref": "item.json"},
        "prefixItems": [{"$ref": "https://example.com/item.json"}, {"$ref": "#/$defs/item"}],
    }
    check_schema(schema, param="p")
