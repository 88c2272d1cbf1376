"""Turn specs that no engine takes natively into a form every engine takes."""

from __future__ import annotations

import json

from corral.grammars.spec import GrammarKind, GrammarSpec


def choice_to_lark(options: list[str]) -> str:
    """A dynamic enum as a Lark grammar: the answer is exactly one option, verbatim (vLLM's `choice`)."""
    # JSON string escaping is valid Lark string-literal escaping for every character we can emit.
    alternatives = " | ".join(json.dumps(option, ensure_ascii=False) for option in options)
    return f"start: {alternatives}\n"


def choice_to_ebnf(options: list[str]) -> str:
    alternatives = " | ".join(json.dumps(option, ensure_ascii=False) for option in options)
    return f"root ::= {alternatives}\n"


def detect_grammar_kind(text: str) -> GrammarKind:
    """GBNF/EBNF uses `::=`; Lark uses `name: body`. Used when the caller does not say which."""
    # Look at rule heads only: `::=` inside a quoted Lark terminal must not flip the verdict.
    heads = (line.split('"')[0].split("'")[0] for line in text.splitlines())
    return GrammarKind.EBNF if any("::=" in head for head in heads) else GrammarKind.LARK


def describe(spec: GrammarSpec) -> str:
    return {
        GrammarKind.JSON_SCHEMA: "JSON Schema",
        GrammarKind.JSON_OBJECT: "JSON object",
        GrammarKind.CHOICE: "choice",
        GrammarKind.REGEX: "regex",
        GrammarKind.EBNF: "EBNF grammar",
        GrammarKind.LARK: "Lark grammar",
        GrammarKind.TOOL_CALLS: "tool-call grammar",
    }[spec.kind]
