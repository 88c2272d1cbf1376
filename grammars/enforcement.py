"""Which JSON Schema keywords a compiled constraint enforces while decoding, and which only the full
post-check (jsonschema + format checker; under `auto` also the contract guard) enforces. For `POST /v1/grammars`
and mediation: a caller can see before generating what the engine will hold and what only the check will.

A conservative reading of each engine's behaviour (samplers/*_backend.py, docs/benchmarks.md): a keyword is
listed under `decode` only where the engine is known to enforce it."""

from __future__ import annotations

import json
from typing import Any

from grammars.features import iter_subschemas, schema_features
from grammars.spec import GrammarKind, GrammarSpec

# Keys that constrain nothing (annotations, containers walked for their subschemas).
_NOT_CONSTRAINTS = frozenset({
    "$schema", "$id", "$comment", "$anchor", "$defs", "definitions", "title", "description", "default", "examples",
    "deprecated", "readOnly", "writeOnly", "format", "x-guidance", "contentMediaType", "contentEncoding",
})
# llguidance's lenient (decode-safe) profile skips keywords it does not implement and compiles oneOf as anyOf.
_LLGUIDANCE_SKIPPED = frozenset({
    "not", "if", "then", "else", "dependencies", "dependentSchemas", "dependentRequired",
    "unevaluatedProperties", "unevaluatedItems", "oneOf",
})
_LLGUIDANCE_FORMATS = frozenset({"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid"})
# xgrammar relaxes these even in a full compile (oneOf as anyOf; formats); its decode-safe compile also keeps
# the keywords it compiles without enforcing (samplers/xgrammar_backend.py IGNORED_KEYWORDS).
_XGRAMMAR_RELAXED = frozenset({"oneOf"})
_XGRAMMAR_IGNORED = frozenset(
    {"contains", "not", "if", "then", "else", "dependentSchemas", "unevaluatedProperties", "unevaluatedItems"}
)


def schemas_of(spec: GrammarSpec) -> list[Any]:
    """The JSON Schemas a spec embeds: the schema, or each tool's parameters; none for other kinds."""
    if spec.kind is GrammarKind.JSON_SCHEMA or spec.kind is GrammarKind.JSON_OBJECT:
        return [spec.schema()]
    if spec.kind is GrammarKind.TOOL_CALLS:
        from grammars.tools import tool_schemas  # grammars.tools builds on grammars.validation, not on this

        return list(tool_schemas(spec))
    return []


def keyword_enforcement(spec: GrammarSpec, backend: str) -> dict[str, list[str]] | None:
    """{"decode": [...], "post_check": [...]} for schema-bearing specs compiled by `backend` (with the
    profile `spec.decode_safe` says); None for grammars, regexes and choices (all enforced while decoding)."""
    schemas = schemas_of(spec)
    if not schemas:
        return None
    used = set().union(*(schema_features(s) for s in schemas)) - _NOT_CONSTRAINTS
    post = {keyword for keyword in used if _relaxed(keyword, backend, spec.decode_safe)}
    # What sits only beneath a relaxed keyword (the `const` in `not: {const: 3}`) is not enforced either.
    pruned = [_without(s, post) for s in schemas]
    decode = set().union(*(schema_features(s) for s in pruned)) - _NOT_CONSTRAINTS - post
    return {"decode": sorted(decode), "post_check": sorted(used - decode)}


def _relaxed(keyword: str, backend: str, decode_safe: bool) -> bool:
    if keyword.startswith("format:"):
        return backend != "llguidance" or keyword.removeprefix("format:") not in _LLGUIDANCE_FORMATS
    if backend == "llguidance":
        return decode_safe and keyword in _LLGUIDANCE_SKIPPED
    return keyword in _XGRAMMAR_RELAXED or (decode_safe and keyword in _XGRAMMAR_IGNORED)


def _without(schema: Any, keywords: set[str]) -> Any:
    """A copy of `schema` with `keywords` (and the subschemas under them) removed everywhere."""
    copy = json.loads(json.dumps(schema))
    for node in iter_subschemas(copy):  # removing a key before the walk descends skips its subtree
        for keyword in keywords & node.keys():
            del node[keyword]
    return copy
