"""Which JSON Schema keywords a compiled constraint enforces while decoding, and which only the full
post-check (jsonschema + format checker; under `auto` also the contract guard) enforces. For `POST /v1/grammars`
and mediation: a caller can see before generating what the engine will hold and what only the check will.

Each backend declares its own table (`KeywordTable` in its `BackendTraits`, corral/grammar_engines/backends/): a
conservative
reading of the engine's behaviour, listing a keyword under `decode` only where the engine is known to enforce
it. A backend that declares no table claims nothing: every keyword is left to the post-check."""

from __future__ import annotations

import json
from typing import Any

from corral.grammars.features import KeywordTable, TraitsOf, iter_subschemas, schema_features, traits_of
from corral.grammars.spec import GrammarKind, GrammarSpec

# Keys that constrain nothing (annotations, containers walked for their subschemas).
_NOT_CONSTRAINTS = frozenset({
    "$schema", "$id", "$comment", "$anchor", "$defs", "definitions", "title", "description", "default", "examples",
    "deprecated", "readOnly", "writeOnly", "format", "x-guidance", "contentMediaType", "contentEncoding",
})


def schemas_of(spec: GrammarSpec) -> list[Any]:
    """The JSON Schemas a spec embeds: the schema, or each tool's parameters; none for other kinds."""
    if spec.kind is GrammarKind.JSON_SCHEMA or spec.kind is GrammarKind.JSON_OBJECT:
        return [spec.schema()]
    if spec.kind is GrammarKind.TOOL_CALLS:
        from corral.grammars.tools import (
            tool_schemas,  # corral.grammars.tools builds on corral.grammars.validation, not on this
        )

        return list(tool_schemas(spec))
    return []


def keyword_enforcement(
    spec: GrammarSpec, backend: str, traits: TraitsOf | None = None
) -> dict[str, list[str]] | None:
    """{"decode": [...], "post_check": [...]} for schema-bearing specs compiled by `backend` (with the
    profile `spec.decode_safe` says); None for grammars, regexes and choices (all enforced while decoding).
    `traits`: where `backend`'s table comes from (default: the registry's lookup, corral.grammars.features)."""
    schemas = schemas_of(spec)
    if not schemas:
        return None
    used = set().union(*(schema_features(s) for s in schemas)) - _NOT_CONSTRAINTS
    table = traits_of(backend, traits).keywords
    if table is None:
        return {"decode": [], "post_check": sorted(used)}
    post = {keyword for keyword in used if _relaxed(keyword, table, spec.decode_safe)}
    # What sits only beneath a relaxed keyword (the `const` in `not: {const: 3}`) is not enforced either.
    pruned = [_without(s, post) for s in schemas]
    decode = set().union(*(schema_features(s) for s in pruned)) - _NOT_CONSTRAINTS - post
    return {"decode": sorted(decode), "post_check": sorted(used - decode)}


def _relaxed(keyword: str, table: KeywordTable, decode_safe: bool) -> bool:
    if keyword.startswith("format:"):
        return keyword.removeprefix("format:") not in table.formats
    return keyword in table.relaxed or (decode_safe and keyword in table.decode_safe_skipped)


def _without(schema: Any, keywords: set[str]) -> Any:
    """A copy of `schema` with `keywords` (and the subschemas under them) removed everywhere."""
    copy = json.loads(json.dumps(schema))
    for node in iter_subschemas(copy):  # removing a key before the walk descends skips its subtree
        for keyword in keywords & node.keys():
            del node[keyword]
    return copy
