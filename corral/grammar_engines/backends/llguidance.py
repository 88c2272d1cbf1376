r"""llguidance, as corral knows it without importing it: traits, keyword table and sandbox codec.

Routing: JSON (json_schema, json_object, tool calls) goes to llguidance first, from measurements
(docs/benchmarks.md, masks mode, 40 schemas per dev subset, 2 CPU cores; the figures when the choice was made:
docs/measured-choices.md#grammar-routing):
- strictness: llguidance accepted 0 invalid instances, xgrammar 15 (keywords: type, oneOf, enum, minItems,
  maximum, additionalProperties, format) — xgrammar relaxes oneOf to anyOf, ignores patternProperties value
  types, and on Github_trivial/o44455 (root `type: object` + `allOf`) emitted a bare string;
- coverage and compile time: llguidance declared more schemas and compiled them in milliseconds, where
  xgrammar took up to seconds and timed out on many Github_hard and Kubernetes schemas;
- string length bounds: xgrammar 0.2.8 compiles them into huge repetition rules (slow masks) and admits
  raw control characters there.
What llguidance refuses (e.g. `not`, `dependencies`, non-disjoint `oneOf`, unknown formats) falls back to
the next backend. Its decode-safe profile (lenient: unimplemented keywords and unknown formats skipped,
oneOf compiled as anyOf) is tried right after its full compile, before xgrammar's seconds-long compiles:
on the 8,499-schema dev set llguidance refused 891 schemas; xgrammar then compiled 756 of them, timed out
on 25 and 110 were refused by both, mostly for `not` (61), `dependencies` (32) and `if/then/else` (7).

Regexes go to llguidance first too, measured by `corral bench kinds`
(docs/benchmarks.md#mask-cost-per-constraint-kind-corral-bench-kinds): a regex that allows many tokens at a
position costs xgrammar 2-16× more per mask, while narrow ones (dates, timestamps, phone numbers, alternations)
cost both little (one unbounded e-mail is the widest gap the other way). Its regex dialect is also Python's where
the two differ, and Python's `re` is the final check: `.` excludes a newline and `\d`, `\w` are Unicode (xgrammar
lets `.` match a newline, which the check then fails). A regex it refuses (`[\d-z]`) still goes to xgrammar. What
it does not bound at compile time: its lexer is built lazily, so a regex that explodes it (300 counted repetitions
in a row, which xgrammar refuses at the compile deadline) compiles in milliseconds and fails at a later mask with
the lexer's own limit, so such regexes yield to xgrammar (`heavy_counts`). Grammars and choices stay with xgrammar
(corral/grammar_engines/backends/xgrammar.py says why), but for wide Lark grammars that provably lex the same
greedily, which xgrammar yields (a Lark grammar's counts past MAX_COUNTED make llguidance yield it back)."""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from corral.grammar_engines.protocol import BackendDescriptor, CompiledGrammar, Lazy, SamplerBackend
from corral.grammars.features import SCHEMA_KINDS, BackendTraits, KeywordTable
from corral.grammars.json_walk import objects_in
from corral.grammars.spec import GrammarKind, GrammarSpec

NAME = "llguidance"
# What the lenient (decode-safe) profile skips or relaxes; the full compile refuses these instead.
DECODE_SAFE_SKIPPED = frozenset({
    "not", "if", "then", "else", "dependencies", "dependentSchemas", "dependentRequired",
    "unevaluatedProperties", "unevaluatedItems", "oneOf",
})
FORMATS = frozenset({"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid"})

# llguidance builds a regex's lexer lazily, at mask time, where only its own limits bound the cost (on the engine
# thread, holding up every request's step): 300 counted repetitions in a row (their counts sum to ~60,000)
# compile at once and fail ~10 tokens in ("too many expressions constructed"); `((x{1000}){1000}){1000}`
# (3,000) spent 1.3 s in its first mask and failed. xgrammar refuses the first at the compile deadline, in a
# killable worker, and serves the second. The wide regexes measured faster here sum to 73 at most (measured:
# docs/measured-choices.md#counted-repetitions-under-llguidance).
MAX_COUNTED = 1_000
_COUNTED = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


# A property-name pattern (`patternProperties`) is unanchored in JSON Schema, and llguidance's lexer for such a
# key (any text around the match, and not any declared name) explodes sooner: `[A-Za-z0-9-_.:]{1,128}` failed
# two tokens into the key ("too many expressions constructed"; Github_trivial/o78117 has {1,255}), {1,100}
# held; anchored (`^...$`) names held at {1,2000}. xgrammar compiles such schemas (the contract guard checks
# the value types it does not).
MAX_COUNTED_UNANCHORED_KEY = 64


def heavy_counts(spec: GrammarSpec) -> bool:
    """A regex or Lark grammar whose repetition counts (`{m}`, `{m,n}`) sum past MAX_COUNTED, or a JSON Schema with
    an unanchored property-name pattern whose counts sum past MAX_COUNTED_UNANCHORED_KEY: `auto` tries xgrammar
    first (a Lark grammar xgrammar yields to llguidance, corral/grammars/lark_lexing.py, has its terminals lexed lazily
    just the same)."""
    if spec.kind in (GrammarKind.REGEX, GrammarKind.LARK):
        return _counted(spec.source) > MAX_COUNTED
    if spec.kind in SCHEMA_KINDS and spec.embeds_schema and "patternProperties" in spec.source:
        return _heavy_unanchored_key(spec.source)
    return False


def _counted(regex: str) -> int:
    total = 0
    for low, high in _COUNTED.findall(regex):
        count = max(low, high, key=lambda digits: (len(digits), digits))
        total += MAX_COUNTED + 1 if len(count) > 6 else int(count)
        if total > MAX_COUNTED:
            break
    return total


@functools.lru_cache(maxsize=256)
def _heavy_unanchored_key(source: str) -> bool:
    try:
        schema = json.loads(source)
    except ValueError:
        return False  # not this rule's business: the compile reports a bad schema
    for node in objects_in(schema):
        patterns = node.get("patternProperties")
        if isinstance(patterns, dict):
            for name in patterns:
                anchored = name.startswith("^") and name.endswith("$")
                if not anchored and _counted(name) > MAX_COUNTED_UNANCHORED_KEY:
                    return True
    return False


# First for JSON and regexes (except heavy_counts), second for grammars and choices (the docstring says why).
TRAITS = BackendTraits(
    rank={kind: 1 if kind in SCHEMA_KINDS or kind is GrammarKind.REGEX else 2 for kind in GrammarKind},
    yields=heavy_counts,
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


DESCRIPTOR = BackendDescriptor(
    Lazy("corral.grammar_engines.llguidance_backend:LLGuidanceBackend"), TRAITS, LLGuidanceCodec
)
