"""The full contract of a finished answer: the check that runs after generation, whatever the engine enforced.

It sits above both `validation` (schemas) and `tools` (tool-call answers), so neither imports the other."""

from __future__ import annotations

import json
import re

from corral.grammars.spec import GrammarKind, GrammarSpec
from corral.grammars.tools import ToolAnswer, validate_tool_answer
from corral.grammars.validation import OutputCheck, schema_error


def validate_output(spec: GrammarSpec, text: str) -> OutputCheck:
    """Validate a finished answer against the *full* contract (not the decode-time subset). An answer
    nested too deeply for the recursive checkers (a recursive schema lets the model go on nesting) fails
    closed: it is never taken for valid."""
    try:
        return _validate_output(spec, text)
    except RecursionError:
        return OutputCheck(False, "the answer nests too deeply to check against the full contract")


def _validate_output(spec: GrammarSpec, text: str) -> OutputCheck:
    if spec.is_json:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            return OutputCheck(False, f"not JSON: {exc}")
        error = schema_error(spec.schema(), value)
        return OutputCheck(error is None, error, value)
    if spec.kind is GrammarKind.TOOL_CALLS:
        return validate_tool_answer(spec, text)
    if spec.kind is GrammarKind.CHOICE:
        ok = text in spec.choices()
        return OutputCheck(ok, None if ok else "answer is not one of the choices", text)
    if spec.kind is GrammarKind.REGEX:
        try:
            ok = re.fullmatch(spec.source, text) is not None
        except re.error:
            return OutputCheck(True, None, text)  # engine regex dialect Python cannot read: trust the engine
        return OutputCheck(ok, None if ok else "answer does not match the regex", text)
    # Grammars: the matcher accepted every token and reached an accepting state; that is the check.
    return OutputCheck(True, None, text)


def has_tool_calls(check: OutputCheck | None) -> bool:
    """Whether a checked answer is valid tool calls (not text under `tool_choice: auto`)."""
    return check is not None and check.valid and isinstance(check.value, ToolAnswer) and bool(check.value.calls)
