"""The frozen description of one constraint: what the caller asked for, in canonical text."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any, Literal, get_args


class GrammarKind(StrEnum):
    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"
    CHOICE = "choice"
    REGEX = "regex"
    EBNF = "ebnf"  # GBNF / xgrammar EBNF: `root ::= ...`
    LARK = "lark"
    TOOL_CALLS = "tool_calls"  # source: corral/grammars/tools.py's canonical JSON (format, mode, tools, ...)


# Where a JSON answer may hold whitespace (GrammarSpec.whitespace). fixed: `", "` between items, `": "` after keys,
# nothing else, one line. free: a bounded gap (FREE_GAP_*) between any two tokens, the model's own layout.
JsonWhitespace = Literal["fixed", "free"]
JSON_WHITESPACE: tuple[JsonWhitespace, ...] = get_args(JsonWhitespace)

# free's bound on one gap, llama.cpp's json-schema-to-grammar `space` rule: one space, or one or two newlines and at
# most this many spaces or tabs (an indent of 2 holds ten levels). Each gap is bounded and the gaps are separated by
# JSON tokens, so a model cannot loop on whitespace. The backends write it in their own terms.
FREE_GAP_NEWLINES = 2
FREE_GAP_INDENT = 20


def canonical_json(value: Any) -> str:
    """Compact JSON. Key order is kept, not sorted: engines emit properties in declared order, and
    callers rely on it (e.g. reasoning fields before the answer)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True)
class GrammarSpec:
    """One constraint. `source` is canonical text: JSON for schemas and choices, the grammar or
    regex verbatim otherwise. Immutable, so it is safe as a cache key across threads."""

    kind: GrammarKind
    source: str
    # The decode-time profile of a JSON Schema: the engine may relax what it cannot enforce (llguidance
    # lenient + oneOf as anyOf; xgrammar keeps keywords it ignores) because the caller enforces the
    # full schema where the answer ends (corral/grammar_engines/contract_guard.py). Only `auto` compiles it.
    decode_safe: bool = False
    # JSON kinds: one optional space or newline before the value. A prompt ending in a label (`JSON:`) makes a
    # model write ` {` as one token; a grammar that must start at `{` forbids it and sends the answer down
    # another path from its first token (measured in docs/quality.md). The value itself is unchanged.
    leading_whitespace: bool = False
    # JSON kinds: whitespace inside the value. An instruction-tuned model writes its JSON pretty-printed; `fixed`
    # holds it to one line, `free` lets it keep its layout, each gap bounded (FREE_GAP_*).
    whitespace: JsonWhitespace = "fixed"

    @property
    def key(self) -> str:
        digest = hashlib.sha256(f"{self.kind}\0{self.source}".encode()).hexdigest()
        profile = (
            (":decode_safe" if self.decode_safe else "")
            + (":leading_whitespace" if self.leading_whitespace else "")
            + (f":whitespace_{self.whitespace}" if self.whitespace != "fixed" else "")
        )
        return f"{self.kind}:{digest[:24]}{profile}"

    def relaxed(self) -> GrammarSpec:
        """The decode-safe profile of this JSON Schema (or tool-call) spec: same text, relaxed compile."""
        if self.kind not in (GrammarKind.JSON_SCHEMA, GrammarKind.TOOL_CALLS):
            raise ValueError(f"a {self.kind} constraint has no decode-safe profile")
        return replace(self, decode_safe=True)

    def with_leading_whitespace(self, allowed: bool = True) -> GrammarSpec:
        """This spec with `leading_whitespace` set where it applies (JSON kinds); other kinds are returned as
        they are (a choice, regex or grammar says exactly what the text is)."""
        return replace(self, leading_whitespace=allowed) if self.is_json else self

    def with_whitespace(self, mode: str) -> GrammarSpec:
        """This spec with `whitespace` set where it applies (JSON kinds), as `with_leading_whitespace`."""
        for known in JSON_WHITESPACE:
            if mode == known:
                return replace(self, whitespace=known) if self.is_json else self
        raise ValueError(f"JSON whitespace is one of {', '.join(JSON_WHITESPACE)}, not {mode!r}")

    @property
    def is_json(self) -> bool:
        return self.kind in (GrammarKind.JSON_SCHEMA, GrammarKind.JSON_OBJECT)

    @property
    def embeds_schema(self) -> bool:
        """JSON Schemas inside (json_schema, json_object, tool calls): an engine that refuses one of them
        is an engine gap (`auto` tries the next), not the caller's mistake."""
        return self.is_json or self.kind is GrammarKind.TOOL_CALLS

    def schema(self) -> dict[str, Any] | bool:
        """The JSON Schema this spec enforces (json kinds only)."""
        if self.kind is GrammarKind.JSON_OBJECT:
            return {"type": "object"}
        if self.kind is GrammarKind.JSON_SCHEMA:
            loaded: dict[str, Any] | bool = json.loads(self.source)
            return loaded
        raise ValueError(f"a {self.kind} constraint has no JSON Schema")

    def choices(self) -> list[str]:
        if self.kind is not GrammarKind.CHOICE:
            raise ValueError(f"a {self.kind} constraint has no choices")
        loaded: list[str] = json.loads(self.source)
        return loaded

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool) -> GrammarSpec:
        return cls(GrammarKind.JSON_SCHEMA, canonical_json(schema))

    @classmethod
    def json_object(cls) -> GrammarSpec:
        return cls(GrammarKind.JSON_OBJECT, "")

    @classmethod
    def choice(cls, options: list[str]) -> GrammarSpec:
        return cls(GrammarKind.CHOICE, canonical_json(list(options)))

    @classmethod
    def regex(cls, pattern: str) -> GrammarSpec:
        return cls(GrammarKind.REGEX, pattern)

    @classmethod
    def ebnf(cls, grammar: str) -> GrammarSpec:
        return cls(GrammarKind.EBNF, grammar)

    @classmethod
    def lark(cls, grammar: str) -> GrammarSpec:
        return cls(GrammarKind.LARK, grammar)

    @classmethod
    def tool_calls(cls, description: dict[str, Any]) -> GrammarSpec:
        """Built by corral.grammars.tools.tool_calls_spec, which checks the description."""
        return cls(GrammarKind.TOOL_CALLS, canonical_json(description))
