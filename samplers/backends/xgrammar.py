"""xgrammar, as corral knows it without importing it: traits, keyword table, where its engine and codec are.

Routing (docs/benchmarks.md, masks mode, 40 schemas per dev subset, 2 CPU cores): xgrammar ranks first for
grammars, regexes and choices, where both engines compile and xgrammar's masks were the faster (TBM p50
3-14 µs), and second for JSON Schema (see samplers/backends/llguidance.py for why). It refuses the keywords it
would silently ignore (IGNORED_KEYWORDS), so a schema llguidance refused and xgrammar takes is held where the
engine can; what it compiles but relaxes (`oneOf` as `anyOf`, formats, some `enum` and `maximum`) is closed
by the contract guard that `auto` serves through (samplers/contract_guard.py)."""

from __future__ import annotations

from grammars.features import SCHEMA_KINDS, BackendTraits, KeywordTable
from grammars.spec import GrammarKind
from samplers.protocol import BackendDescriptor, Lazy

NAME = "xgrammar"
# Keywords xgrammar 0.2.8 compiles without enforcing (seen: `contains` gave `[]`, `not` gave a string);
# refusing them lets `auto` try another backend or say clearly that none can enforce the schema. The
# decode-safe profile keeps them (the contract guard enforces them where the answer ends).
IGNORED_KEYWORDS = frozenset(
    {"contains", "not", "if", "then", "else", "dependentSchemas", "unevaluatedProperties", "unevaluatedItems"}
)
# Relaxed even by a full compile: oneOf is compiled as anyOf; no string format is enforced.
RELAXED_KEYWORDS = frozenset({"oneOf"})

TRAITS = BackendTraits(
    rank={kind: 2 if kind in SCHEMA_KINDS else 1 for kind in GrammarKind},
    relaxed_profile=True,
    keywords=KeywordTable(relaxed=RELAXED_KEYWORDS, decode_safe_skipped=IGNORED_KEYWORDS),
)

# Its codec (XGrammarCodec: small grammars cross serialised) lives with the engine, which it needs.
DESCRIPTOR = BackendDescriptor(
    Lazy("samplers.xgrammar_backend:XGrammarBackend"), TRAITS, Lazy("samplers.xgrammar_backend:XGrammarCodec")
)
