"""xgrammar, as corral knows it without importing it: traits, keyword table, where its engine and codec are.

Routing: xgrammar ranks first for grammars (EBNF/GBNF, Lark) and choices, second for JSON Schema and regexes
(corral/grammar_engines/backends/llguidance.py says why). Measured by `corral bench kinds`
(docs/benchmarks.md#mask-cost-per-constraint-kind-corral-bench-kinds):
- choices: xgrammar's masks are the cheaper, for 3 to 500 options and for a step of 8 rows alike;
- grammars: correctness before speed. llguidance fills wide grammars' masks faster (a CSV Lark grammar several
  times; narrow ones cost both little), but it lexes terminals greedily, which xgrammar (a character-level CFG,
  as GBNF is defined) does not: under llguidance `root ::= x "ab"`, `x ::= "a"*` refuses "aaab", a Lark terminal
  `/[a-z]+/` before "b" refuses "aab", and llguidance 1.9.1's mask after "aa" on the first grammar did not return
  (minutes, growing memory), which would hold up every request's step. Except a wide Lark grammar whose terminals
  provably lex the same greedily (corral/grammars/lark_lexing.py: a CSV's cells, words between spaces, key=value
  pairs): there both engines accept the same texts, and xgrammar yields it to llguidance.
For JSON Schema it refuses the keywords it would silently ignore (IGNORED_KEYWORDS), so a schema llguidance
refused and xgrammar takes is held where the engine can; what it compiles but relaxes (`oneOf` as `anyOf`,
formats, some `enum` and `maximum`) is closed by the contract guard that `auto` serves through
(corral/grammar_engines/contract_guard.py). It is given each JSON Schema with the keywords beside an
`anyOf`/`oneOf` moved into the branches (corral/grammars/combinator_siblings.py): it drops them otherwise, and a
branch that names no type lets the answer be any JSON value."""

from __future__ import annotations

from corral.grammar_engines.protocol import BackendDescriptor, Lazy
from corral.grammars.features import SCHEMA_KINDS, BackendTraits, KeywordTable
from corral.grammars.lark_lexing import wide_and_exact
from corral.grammars.spec import GrammarKind, GrammarSpec

NAME = "xgrammar"
# Keywords xgrammar 0.2.8 compiles without enforcing (seen: `contains` gave `[]`, `not` gave a string);
# refusing them lets `auto` try another backend or say clearly that none can enforce the schema. The
# decode-safe profile keeps them (the contract guard enforces them where the answer ends).
IGNORED_KEYWORDS = frozenset(
    {"contains", "not", "if", "then", "else", "dependentSchemas", "unevaluatedProperties", "unevaluatedItems"}
)
# Relaxed even by a full compile: oneOf is compiled as anyOf; no string format is enforced.
RELAXED_KEYWORDS = frozenset({"oneOf"})


def yields_lark(spec: GrammarSpec) -> bool:
    """A wide Lark grammar that greedy lexing provably reads as its CFG (corral/grammars/lark_lexing.py): llguidance
    fills its masks several times faster and accepts exactly the same texts, so `auto` tries it first."""
    return spec.kind is GrammarKind.LARK and wide_and_exact(spec.source)


# First for grammars and choices, second for JSON and regexes (the module docstring says why).
TRAITS = BackendTraits(
    rank={kind: 2 if kind in SCHEMA_KINDS or kind is GrammarKind.REGEX else 1 for kind in GrammarKind},
    yields=yields_lark,
    relaxed_profile=True,
    keywords=KeywordTable(relaxed=RELAXED_KEYWORDS, decode_safe_skipped=IGNORED_KEYWORDS),
)

# Its codec (XGrammarCodec: small grammars cross serialised) lives with the engine, which it needs.
DESCRIPTOR = BackendDescriptor(
    Lazy("corral.grammar_engines.xgrammar_backend:XGrammarBackend"),
    TRAITS,
    Lazy("corral.grammar_engines.xgrammar_backend:XGrammarCodec"),
)
