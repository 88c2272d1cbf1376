"""Feature scan of a JSON Schema, and `auto` routing by what each enabled backend declares about itself.

The grammars layer names no engine: a backend's routing traits and keyword table (`BackendTraits`, plain
data) are declared beside the backend (corral/grammar_engines/backends/) and reach this module either from the caller
(`traits=`, as corral.grammar_engines.compilation passes `BackendSet.traits`) or through the lookup the grammar engines
registry
installs with `use_traits` when it is imported. Until then every backend has the neutral `BackendTraits()`."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from corral.grammars.spec import GrammarKind, GrammarSpec

# Subschema-holding keywords, walked to find every keyword a schema uses anywhere (and by the schema rewrites:
# corral/grammars/combinator_siblings.py). A single one may hold a list: draft 4's tuple `items`.
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
SCHEMA_SINGLE = (
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
# The spec kinds that embed JSON Schema documents (GrammarSpec.embeds_schema).
SCHEMA_KINDS = frozenset({GrammarKind.JSON_SCHEMA, GrammarKind.JSON_OBJECT, GrammarKind.TOOL_CALLS})
UNRANKED = 100  # the rank of a kind a backend does not rank: after every ranked backend, in the enabled order
YIELDED = 50  # added to a backend's rank for a spec it yields (BackendTraits.yields): after the other ranked ones


@dataclass(frozen=True)
class KeywordTable:
    """What a backend's compile of a JSON Schema does not enforce while decoding (corral/grammars/enforcement.py)."""

    relaxed: frozenset[str] = frozenset()  # compiled without being enforced, in either profile
    decode_safe_skipped: frozenset[str] = frozenset()  # also not enforced by the decode-safe profile
    formats: frozenset[str] = frozenset()  # string formats enforced while decoding (others: the post-check)


@dataclass(frozen=True)
class BackendTraits:
    """What `auto` and `POST /v1/grammars` need to know about a backend, without loading its engine.

    The neutral default (a plug-in that declares nothing) takes every kind, ranks none, has no decode-safe
    profile and no keyword table: it is tried after the ranked backends, and every schema keyword it
    compiles is reported as enforced only by the post-check."""

    kinds: frozenset[GrammarKind] = frozenset(GrammarKind)  # what it compiles; `auto` skips it for others
    rank: Mapping[GrammarKind, int] = field(default_factory=dict)  # lower is tried first; missing: UNRANKED
    relaxed_profile: bool = False  # compiles GrammarSpec.decode_safe differently: `auto` tries it as well
    keywords: KeywordTable | None = None  # None: nothing is known, so nothing is claimed
    lark_json: bool = False  # takes Lark grammars with `%json` blocks (how mediation's dispatch markers ride)
    # A shape of a ranked kind the backend handles badly (a cheap look at the source, no compile): for such a
    # spec `auto` tries it after the other backends that rank the kind.
    yields: Callable[[GrammarSpec], bool] | None = None

    def rank_for(self, kind: GrammarKind) -> int:
        return self.rank.get(kind, UNRANKED)

    def rank_of(self, spec: GrammarSpec) -> int:
        rank = self.rank_for(spec.kind)
        if rank != UNRANKED and self.yields is not None and self.yields(spec):
            return rank + YIELDED
        return rank


TraitsOf = Callable[[str], BackendTraits]


def _neutral(_: str) -> BackendTraits:
    return BackendTraits()


_installed: list[TraitsOf] = [_neutral]


def use_traits(lookup: TraitsOf) -> None:
    """Install the process-wide traits lookup (the grammar engines' registry does, on import)."""
    _installed[0] = lookup


def traits_of(name: str, traits: TraitsOf | None = None) -> BackendTraits:
    """`name`'s traits from `traits`, else from the installed lookup."""
    return (traits or _installed[0])(name)


def iter_subschemas(schema: Any) -> Iterator[dict[str, Any]]:
    """Every object-valued (sub)schema, depth first, the root included."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        yield node
        for key in SCHEMA_MAPS:
            value = node.get(key)
            if isinstance(value, dict):
                stack.extend(value.values())
        for key in SCHEMA_LISTS:
            value = node.get(key)
            if isinstance(value, list):
                stack.extend(value)
        for key in SCHEMA_SINGLE:
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


def route(spec: GrammarSpec, available: Sequence[str], traits: TraitsOf | None = None) -> list[str]:
    """Backends to try for `backend=auto`, best first: each available backend that takes the spec's kind
    once, by its rank for that kind, unless it yields the spec (ties, and backends that rank nothing, keep the
    `available` order).
    Why each built-in ranks as it does, with the measurements, is in corral/grammar_engines/backends//"""
    declared = [(name, traits_of(name, traits)) for name in available]
    taking = [(name, t) for name, t in declared if spec.kind in t.kinds]
    return [name for name, t in sorted(taking, key=lambda pair: pair[1].rank_of(spec))]


def attempts(
    spec: GrammarSpec, available: Sequence[str], traits: TraitsOf | None = None
) -> list[tuple[str, GrammarSpec]]:
    """What `auto` compiles, in order: (backend, spec) pairs. A JSON Schema (and a tool-call spec, whose
    functions' schemas compile the same way) also gets each backend's decode-safe profile right after its full
    compile, where the backend has one (`relaxed_profile`); that profile is served only behind the contract
    guard (corral/grammar_engines/contract_guard.py), which enforces at the answer's end what the engine relaxed."""
    names = route(spec, available, traits)
    if spec.kind not in (GrammarKind.JSON_SCHEMA, GrammarKind.TOOL_CALLS):
        return [(name, spec) for name in names]
    plan: list[tuple[str, GrammarSpec]] = []
    for name in names:
        plan.append((name, spec))
        if traits_of(name, traits).relaxed_profile:
            plan.append((name, spec.relaxed()))
    return plan
