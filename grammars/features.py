"""Feature scan of a JSON Schema: which keywords it uses, so `auto` can pick the engine that enforces them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from grammars.spec import GrammarKind, GrammarSpec

# Subschema-holding keywords, walked to find every keyword a schema uses anywhere.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_SINGLE = (
    "items",
    "additionalProperties",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
    "additionalItems",
)


def iter_subschemas(schema: Any) -> Iterator[dict[str, Any]]:
    """Every object-valued (sub)schema, depth first, the root included."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        yield node
        for key in _SCHEMA_MAPS:
            value = node.get(key)
            if isinstance(value, dict):
                stack.extend(value.values())
        for key in _SCHEMA_LISTS:
            value = node.get(key)
            if isinstance(value, list):
                stack.extend(value)
        for key in _SCHEMA_SINGLE:
            value = node.get(key)
            if isinstance(value, dict):
                stack.append(value)
            elif isinstance(value, list):  # draft-4 tuple `items`
                stack.extend(value)


def schema_features(schema: Any) -> frozenset[str]:
    """Keywords in use, plus `format:<name>` for each string format."""
    found: set[str] = set()
    for node in iter_subschemas(schema):
        found.update(node.keys())
        fmt = node.get("format")
        if isinstance(fmt, str):
            found.add(f"format:{fmt}")
    return frozenset(found)


def route(spec: GrammarSpec, available: list[str]) -> list[str]:
    """Backends to try for `backend=auto`, best first; every available backend appears once."""
    preferred = ["xgrammar", "llguidance"]
    if spec.kind in (GrammarKind.JSON_SCHEMA,):
        features = schema_features(spec.schema())
        # xgrammar 0.2.8 compiles string length bounds into huge repetition rules: slow masks, and the
        # bounded string admits raw control characters (invalid JSON). llguidance lexes them exactly.
        if features & {"maxLength", "minLength"}:
            preferred = ["llguidance", "xgrammar"]
        # xgrammar 0.2.8 warns "allOf with multiple options is still ongoing" and, on
        # Github_trivial/o44455 (root `type: object` + `allOf`), emitted a bare JSON string; it also
        # relaxes oneOf to anyOf. llguidance enforces both.
        if features & {"allOf", "oneOf"}:
            preferred = ["llguidance", "xgrammar"]
    ordered = [name for name in preferred if name in available]
    return ordered + [name for name in available if name not in ordered]
