"""What a mediated call must return: a JSON Schema, the typed value parsed from it, and its version."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Generic, TypeVar

import jsonschema
from jsonschema import Draft202012Validator
from pydantic import BaseModel

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

_FORMATS = Draft202012Validator.FORMAT_CHECKER
OPTION_KEY = "choice"  # the one property a DynamicEnumSchema's object carries


def _identity(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class SchemaVersion:
    """An older version still accepted until `accepted_until` (UTC); `upgrade` turns its value into the
    current version's shape, so downstream code only ever sees the current type."""

    version: str
    schema: dict[str, Any]
    accepted_until: datetime | None = None
    upgrade: Callable[[Any], Any] = _identity

    def accepted(self, now: datetime) -> bool:
        return self.accepted_until is None or now < self.accepted_until


@dataclass(frozen=True)
class OutputSchema(Generic[T]):
    """The contract of one mediated call. `schema` is the full schema (validated in full after decoding;
    decode-time engines may relax it); `parse` turns a schema-valid JSON value into `T` (a ValueError or
    pydantic ValidationError there is a schema failure too)."""

    name: str
    schema: dict[str, Any]
    parse: Callable[[Any], T]
    version: str = "v1"
    previous: Sequence[SchemaVersion] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for schema in (self.schema, *(v.schema for v in self.previous)):
            jsonschema.validators.validator_for(schema, default=Draft202012Validator).check_schema(schema)

    @staticmethod
    def from_model(model: type[M], *, name: str | None = None, version: str = "v1",
                   previous: Sequence[SchemaVersion] = ()) -> OutputSchema[M]:
        """From a pydantic model: its JSON Schema, parsed back with `model_validate`."""
        return OutputSchema(name or model.__name__, model.model_json_schema(), model.model_validate, version,
                            tuple(previous))

    @staticmethod
    def from_json_schema(schema: dict[str, Any], *, name: str = "result", version: str = "v1",
                         previous: Sequence[SchemaVersion] = ()) -> OutputSchema[Any]:
        """From a JSON Schema; the value is the parsed JSON itself."""
        return OutputSchema(name, schema, _identity, version, tuple(previous))

    @staticmethod
    def dynamic_enum(options: Sequence[str], *, name: str = "choice", version: str = "v1") -> OutputSchema[str]:
        """A per-call enum made from live data (agent ids, categories, ...). Wrapped in an object so every
        mode can carry it (JSON object mode cannot return a bare string); the value is the option itself."""
        unique = list(dict.fromkeys(options))
        if not unique or not all(isinstance(o, str) for o in unique):
            raise ValueError("a dynamic enum needs at least one string option")
        schema = {
            "type": "object",
            "properties": {OPTION_KEY: {"type": "string", "enum": unique}},
            "required": [OPTION_KEY],
            "additionalProperties": False,
        }
        return OutputSchema(name, schema, _pick_option, version)

    def check(self, value: Any, now: datetime | None = None) -> SchemaCheck:
        """The first version `value` satisfies (the current one, then older ones before their cut-off), with
        the value upgraded to the current shape; else the current version's most relevant error."""
        error = schema_error(self.schema, value)
        if error is None:
            return SchemaCheck(self.version, value)
        moment = now or datetime.now(UTC)
        for old in self.previous:
            if old.accepted(moment) and schema_error(old.schema, value) is None:
                return SchemaCheck(old.version, old.upgrade(value))
        return SchemaCheck(None, value, path=error[0], error=error[1])


@dataclass(frozen=True)
class SchemaCheck:
    version: str | None  # None: no accepted version holds
    value: Any
    path: str | None = None
    error: str | None = None


def _pick_option(value: Any) -> str:
    option: str = value[OPTION_KEY]
    return option


def schema_error(schema: dict[str, Any], value: Any) -> tuple[str, str] | None:
    """(JSON pointer, message) of the most relevant error of `value` under the full `schema`, or None."""
    validator_cls = jsonschema.validators.validator_for(schema, default=Draft202012Validator)
    validator = validator_cls(schema, format_checker=_FORMATS)
    error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    if error is None:
        return None
    pointer = "/" + "/".join(str(p).replace("~", "~0").replace("/", "~1") for p in error.absolute_path)
    return pointer, error.message
