"""JSON Schema checks as the benchmark defines them, independent of the backends under test."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import jsonschema
from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match

from corral.grammars.formats import FORMAT_CHECKER, format_checker
from corral.grammars.validation import check_schema, json_pointer

UNLABELLED = "(valid under its draft)"  # the data set calls it invalid but the validator finds no error
UNCHECKABLE = "(validator error)"


@dataclass(frozen=True)
class Verdict:
    valid: bool
    error: str | None = None


def validate_generated(schema: Any, text: str) -> Verdict:
    """JSONSchemaBench's compliance test: the text parses as JSON and validates with
    Draft202012Validator + format checker (whatever `$schema` the schema declares)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return Verdict(False, f"not JSON: {exc}")
    try:
        error = best_match(Draft202012Validator(schema, format_checker=FORMAT_CHECKER).iter_errors(value))
    except Exception as exc:  # a schema the validator cannot evaluate (bad regex, unresolvable $ref)
        return Verdict(False, f"{UNCHECKABLE} {type(exc).__name__}: {exc}")
    if error is None:
        return Verdict(True)
    return Verdict(False, f"at {json_pointer(error.absolute_path)}: {error.message}"[:300])


def failing_keyword(schema: Any, instance: Any) -> tuple[str, str]:
    """The keyword an invalid instance breaks, and where: what a backend that accepted it did not enforce.
    Uses the schema's own draft (the data set's labels follow it); `format` is split by format name."""
    try:
        cls = jsonschema.validators.validator_for(schema, default=Draft202012Validator)
        error = best_match(cls(schema, format_checker=format_checker(cls)).iter_errors(instance))
    except Exception:
        return UNCHECKABLE, "/"
    if error is None:
        return UNLABELLED, "/"
    keyword = str(error.validator)
    if keyword == "format":
        keyword = f"format:{error.validator_value}"
    return keyword, json_pointer(error.absolute_path)


def meta_valid(schema: Any) -> bool:
    """Whether corral's request check (meta-schema of the declared draft) accepts the schema; the
    server refuses one that fails before any backend sees it."""
    try:
        check_schema(schema, param="schema")
    except ValueError:
        return False
    return True
