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
    """Backends to try for `backend=auto`, best first; every available backend appears once (for JSON
    Schema, `attempts` below adds each engine's decode-safe profile after its full compile).

    JSON goes to llguidance first, xgrammar second, from measurements (docs/benchmarks.md, masks mode,
    40 schemas per dev subset, 2 CPU cores):
    - strictness: llguidance accepted 0 invalid instances, xgrammar 15 (keywords: type, oneOf, enum,
      minItems, maximum, additionalProperties, format) — it relaxes oneOf to anyOf, ignores
      patternProperties value types, and on Github_trivial/o44455 (root `type: object` + `allOf`)
      emitted a bare string;
    - coverage and compile time: llguidance declared 88.2 % vs 82.1 % and compiled in 1-3 ms (p50)
      vs up to 2.3 s; xgrammar timed out on 25/40 Github_hard and 13/40 Kubernetes schemas;
    - string length bounds: xgrammar 0.2.8 compiles them into huge repetition rules (slow masks) and
      admits raw control characters there.
    What llguidance refuses (e.g. `not`, `dependencies`, non-disjoint `oneOf`, unknown formats) falls back
    to xgrammar, which refuses the keywords it would silently ignore (samplers/xgrammar_backend.py). The
    keywords xgrammar does compile but relaxes (`oneOf` as `anyOf`, some `enum`, `maximum`, `format`: 12
    strictness failures in that run, all of them in schemas only xgrammar declared, so routing alone left
    `auto` with 7) are closed by the contract guard that `auto` serves through (samplers/contract_guard.py).
    Grammars, regexes and choices keep xgrammar first: both engines take them and xgrammar's masks
    were the faster there (TBM p50 3-14 µs)."""
    json_kind = spec.embeds_schema  # tool calls too: their arguments are JSON Schema documents
    preferred = ["llguidance", "xgrammar"] if json_kind else ["xgrammar", "llguidance"]
    ordered = [name for name in preferred if name in available]
    return ordered + [name for name in available if name not in ordered]


def attempts(spec: GrammarSpec, available: list[str]) -> list[tuple[str, GrammarSpec]]:
    """What `auto` compiles, in order: (backend, spec) pairs. A JSON Schema also gets its decode-safe
    profile (so does a tool-call spec, whose functions' schemas are compiled the same way), served only
    behind the contract guard: llguidance's first (it compiles in milliseconds
    where xgrammar takes seconds), then xgrammar's full and decode-safe compiles.

    Measured (docs/benchmarks.md, masks mode, the 8,499-schema dev set, before this profile existed):
    llguidance refused 891 schemas; xgrammar then compiled 756 of them (p50 GCT in seconds, not ms),
    timed out on 25 (all 25 refused by llguidance only for `oneOf` or an unknown format), and 110 were
    refused by both, mostly for `not` (61), `dependencies` (32) and `if/then/else` (7) — keywords neither
    engine enforces but the contract guard does where the answer ends."""
    names = route(spec, available)
    if spec.kind not in (GrammarKind.JSON_SCHEMA, GrammarKind.TOOL_CALLS):
        return [(name, spec) for name in names]
    return [(name, variant) for name in names for variant in (spec, spec.relaxed())]
