"""llguidance, as corral knows it without importing it: traits, keyword table and sandbox codec.

Routing: JSON (json_schema, json_object, tool calls) goes to llguidance first, from measurements
(docs/benchmarks.md, masks mode, 40 schemas per dev subset, 2 CPU cores):
- strictness: llguidance accepted 0 invalid instances, xgrammar 15 (keywords: type, oneOf, enum, minItems,
  maximum, additionalProperties, format) — xgrammar relaxes oneOf to anyOf, ignores patternProperties value
  types, and on Github_trivial/o44455 (root `type: object` + `allOf`) emitted a bare string;
- coverage and compile time: llguidance declared 88.2 % vs 82.1 % and compiled in 1-3 ms (p50) vs up to
  2.3 s; xgrammar timed out on 25/40 Github_hard and 13/40 Kubernetes schemas;
- string length bounds: xgrammar 0.2.8 compiles them into huge repetition rules (slow masks) and admits
  raw control characters there.
What llguidance refuses (e.g. `not`, `dependencies`, non-disjoint `oneOf`, unknown formats) falls back to
the next backend. Its decode-safe profile (lenient: unimplemented keywords and unknown formats skipped,
oneOf compiled as anyOf) is tried right after its full compile, before xgrammar's seconds-long compiles:
on the 8,499-schema dev set llguidance refused 891 schemas; xgrammar then compiled 756 of them, timed out
on 25 and 110 were refused by both, mostly for `not` (61), `dependencies` (32) and `if/then/else` (7)."""

from __future__ import annotations

from typing import Any

from grammars.features import SCHEMA_KINDS, BackendTraits, KeywordTable
from grammars.spec import GrammarKind, GrammarSpec
from samplers.protocol import BackendDescriptor, CompiledGrammar, Lazy, SamplerBackend

NAME = "llguidance"
# What the lenient (decode-safe) profile skips or relaxes; the full compile refuses these instead.
DECODE_SAFE_SKIPPED = frozenset({
    "not", "if", "then", "else", "dependencies", "dependentSchemas", "dependentRequired",
    "unevaluatedProperties", "unevaluatedItems", "oneOf",
})
FORMATS = frozenset({"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid"})

TRAITS = BackendTraits(
    rank={kind: 1 if kind in SCHEMA_KINDS else 2 for kind in GrammarKind},
    relaxed_profile=True,
    keywords=KeywordTable(decode_safe_skipped=DECODE_SAFE_SKIPPED, formats=FORMATS),
    lark_json=True,
)


class LLGuidanceCodec:
    """llguidance has no serialisation; building its matcher takes ms, so the parent builds it again."""

    def export(self, compiled: CompiledGrammar) -> Any:
        return None

    def restore(self, impl: SamplerBackend, spec: GrammarSpec, payload: Any) -> CompiledGrammar:
        return impl.compile(spec)


DESCRIPTOR = BackendDescriptor(Lazy("samplers.llguidance_backend:LLGuidanceBackend"), TRAITS, LLGuidanceCodec)
