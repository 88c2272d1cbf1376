"""Turn an OpenAI-style request's constraint fields into one GrammarSpec (or none), or say what is wrong."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from corral.grammars.limits import (
    DEFAULT_LIMITS,
    InputLimits,
    LimitExceeded,
    check_count,
    check_lark_terminals,
    check_schema_limits,
    check_source_length,
)
from corral.grammars.lowering import detect_grammar_kind
from corral.grammars.spec import GrammarKind, GrammarSpec
from corral.grammars.validation import InvalidConstraint, check_schema

AUTO = "auto"
CONSTRAINT_KEYS = ("json", "json_object", "choice", "regex", "grammar")
GRAMMAR_SYNTAXES = {"lark": GrammarKind.LARK, "ebnf": GrammarKind.EBNF, "gbnf": GrammarKind.EBNF}
# vLLM's older request fields, each the structured_outputs key it stands for.
LEGACY_KEYS = {
    "guided_json": "json",
    "guided_json_object": "json_object",
    "guided_choice": "choice",
    "guided_regex": "regex",
    "guided_grammar": "grammar",
    "guided_decoding_backend": "backend",
}
LEGACY_BACKEND_NAMES = {"guidance": "llguidance"}  # vLLM's name for llguidance


@dataclass(frozen=True)
class ConstraintRequest:
    spec: GrammarSpec | None
    backend: str = AUTO
    source: str | None = None  # the request field the constraint came from, for error messages
    backend_source: str = "structured_outputs.backend"  # the field that named the backend


def parse_constraint(
    response_format: Any,
    structured_outputs: Any,
    legacy: Mapping[str, Any] | None = None,
    *,
    limits: InputLimits = DEFAULT_LIMITS,
) -> ConstraintRequest:
    """Exactly one constraint per request; two (in either or both places) is an error. `legacy` holds
    vLLM's older guided_* fields, each read as the structured_outputs key it stands for. Each constraint
    is measured against `limits` before anything else looks at it."""
    found: list[tuple[str, GrammarSpec]] = []
    backend = AUTO
    backend_source = "structured_outputs.backend"
    if response_format is not None:
        spec = _from_response_format(response_format, limits)
        if spec is not None:
            found.append(("response_format", spec))
    if structured_outputs is not None:
        if not isinstance(structured_outputs, dict):
            raise InvalidConstraint("structured_outputs must be an object", param="structured_outputs")
        unknown = set(structured_outputs) - {*CONSTRAINT_KEYS, "backend", "grammar_syntax"}
        if unknown:
            raise InvalidConstraint(
                f"unknown structured_outputs field(s): {', '.join(sorted(unknown))}; expected one of "
                f"{', '.join(CONSTRAINT_KEYS)} (+ backend, grammar_syntax)",
                param="structured_outputs",
            )
        for key in CONSTRAINT_KEYS:
            value = structured_outputs.get(key)
            if value is None or (value is False and key != "json"):  # `json: false` is a schema, not "off"
                continue
            found.append((f"structured_outputs.{key}", _from_structured(key, value, structured_outputs, limits)))
        raw_backend = structured_outputs.get("backend")
        if raw_backend is not None:
            if not isinstance(raw_backend, str) or not raw_backend:
                raise InvalidConstraint(
                    "structured_outputs.backend must be a backend name", param="structured_outputs.backend"
                )
            backend = raw_backend
    for name, value in (legacy or {}).items():
        key = LEGACY_KEYS[name]
        if key != "backend":
            found.append((name, _from_structured(key, value, {}, limits, param=name)))
            continue
        if not isinstance(value, str) or not value:
            raise InvalidConstraint(f"{name} must be a backend name", param=name)
        value = LEGACY_BACKEND_NAMES.get(value, value)
        if isinstance(structured_outputs, dict) and structured_outputs.get("backend") is not None and value != backend:
            raise InvalidConstraint(
                f"{name} ({value!r}) and structured_outputs.backend ({backend!r}) disagree", param=name
            )
        backend, backend_source = value, name
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise InvalidConstraint(
            f"exactly one constraint per request is allowed, got {len(found)}: {names}", param=found[1][0]
        )
    if not found:
        return ConstraintRequest(None, backend, backend_source=backend_source)
    source, spec = found[0]
    return ConstraintRequest(spec, backend, source, backend_source)


def _from_response_format(rf: Any, limits: InputLimits) -> GrammarSpec | None:
    if not isinstance(rf, dict):
        raise InvalidConstraint("response_format must be an object", param="response_format")
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return GrammarSpec.json_object()
    if kind == "json_schema":
        block = rf.get("json_schema")
        if not isinstance(block, dict):
            raise InvalidConstraint(
                "response_format.json_schema must be an object with a 'schema'", param="response_format.json_schema"
            )
        schema = block.get("schema", block.get("json_schema"))
        if schema is None:
            raise InvalidConstraint(
                "response_format.json_schema.schema is required", param="response_format.json_schema.schema"
            )
        return _schema_spec(schema, "response_format.json_schema.schema", limits)
    raise InvalidConstraint(
        f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
        param="response_format.type",
    )


def _schema_spec(schema: Any, param: str, limits: InputLimits) -> GrammarSpec:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise InvalidConstraint(
                f"{param} is not valid JSON: {exc.msg} at line {exc.lineno}:{exc.colno}", param=param
            ) from exc
        except RecursionError as exc:  # far deeper than max_schema_depth
            raise LimitExceeded(
                f"{param} nests deeper than {limits.max_schema_depth} levels (limit --max-schema-depth)",
                param=param,
                code="schema_too_deep",
            ) from exc
    if schema is False:  # valid JSON Schema, but no answer can satisfy it: refuse rather than fail open
        raise InvalidConstraint(f"{param} is `false`, a schema that no value satisfies", param=param)
    check_schema_limits(schema, limits, param=param)
    check_schema(schema, param=param)
    return GrammarSpec.json_schema(schema)


def _from_structured(
    key: str, value: Any, block: dict[str, Any], limits: InputLimits, *, param: str | None = None
) -> GrammarSpec:
    param = param or f"structured_outputs.{key}"
    if key == "json":
        return _schema_spec(value, param, limits)
    if key == "json_object":
        if value is not True:
            raise InvalidConstraint(f"{param} must be true", param=param)
        return GrammarSpec.json_object()
    if key == "choice":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise InvalidConstraint(f"{param} must be a list of strings", param=param)
        if not value:
            raise InvalidConstraint(f"{param} is empty: give at least one choice", param=param)
        check_count(len(value), limits.max_choices, what="choices", flag="max-choices", param=param)
        if any(v == "" for v in value):
            raise InvalidConstraint(f"{param} contains an empty string", param=param)
        return GrammarSpec.choice(list(dict.fromkeys(value)))
    if key == "regex":
        if not isinstance(value, str) or not value:
            raise InvalidConstraint(f"{param} must be a non-empty string", param=param)
        check_source_length(value, limits.max_regex_length, what="regex", flag="max-regex-length", param=param)
        return GrammarSpec.regex(value)
    # grammar
    if not isinstance(value, str) or not value.strip():
        raise InvalidConstraint(f"{param} must be a non-empty grammar string", param=param)
    check_source_length(value, limits.max_grammar_length, what="grammar", flag="max-grammar-length", param=param)
    syntax = block.get("grammar_syntax")
    if syntax is None:
        kind = detect_grammar_kind(value)
    elif isinstance(syntax, str) and syntax.lower() in GRAMMAR_SYNTAXES:
        kind = GRAMMAR_SYNTAXES[syntax.lower()]
    else:
        raise InvalidConstraint(
            f"structured_outputs.grammar_syntax must be one of {', '.join(GRAMMAR_SYNTAXES)}, got {syntax!r}",
            param="structured_outputs.grammar_syntax",
        )
    if kind is GrammarKind.LARK:
        check_lark_terminals(value, limits.max_grammar_length, param=param)
    return GrammarSpec(kind, value)
