"""A semantic rule derived from each benchmark schema: what the schema allows but a caller would refuse
(a negative count, an empty name). Each rule is also said as JSON Schema (its decode hint), so a repair round
under schema_constrained can have the engine enforce it."""

from __future__ import annotations

from typing import Any

from corral.mediation import Rule

_NUMBERS = ("integer", "number")


def derive_rule(schema: Any) -> Rule | None:
    """The rule for the first top-level property it fits, or None (the schema is then not used)."""
    if not isinstance(schema, dict) or "$ref" in schema or schema.get("type", "object") != "object":
        return None
    properties = schema.get("properties")
    if not isinstance(properties, dict):
        return None
    for name, sub in properties.items():
        if not isinstance(sub, dict) or {"enum", "const", "$ref", "anyOf", "oneOf", "allOf"} & sub.keys():
            continue
        if sub.get("type") in _NUMBERS and _allows_non_negative(sub):
            return _non_negative(name)
        if sub.get("type") == "string" and not {"pattern", "format"} & sub.keys() and sub.get("maxLength", 1) >= 1:
            return _non_empty(name)
    return None


def _allows_non_negative(sub: dict[str, Any]) -> bool:
    maximum, exclusive = sub.get("maximum", 0), sub.get("exclusiveMaximum", 1)
    return isinstance(maximum, (int, float)) and maximum >= 0 and isinstance(exclusive, (int, float)) and exclusive > 0


def _non_negative(name: str) -> Rule:
    def check(value: Any) -> bool:
        item = value.get(name) if isinstance(value, dict) else None
        return not isinstance(item, (int, float)) or item >= 0

    return Rule(f"{name}_non_negative", check, f"{name} must not be negative", path=f"/{_escape(name)}",
                decode_hint={"properties": {name: {"minimum": 0}}})


def _non_empty(name: str) -> Rule:
    def check(value: Any) -> bool:
        item = value.get(name) if isinstance(value, dict) else None
        return not isinstance(item, str) or len(item) >= 1

    return Rule(f"{name}_non_empty", check, f"{name} must not be empty", path=f"/{_escape(name)}",
                decode_hint={"properties": {name: {"minLength": 1}}})


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")
