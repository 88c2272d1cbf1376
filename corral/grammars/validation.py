"""Check a constraint before compiling it (JSON Schema against its meta-schema, $refs, regex hints), and
the JSON Schema check answers are held to (`schema_error`; the whole answer check is corral/grammars/contract.py)."""

from __future__ import annotations

import hashlib
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any
from urllib.parse import urldefrag, urljoin

import jsonschema
from jsonschema import Draft202012Validator

from corral.grammars.formats import FORMAT_CHECKER
from corral.grammars.json_walk import objects_in
from corral.grammars.spec import canonical_json


class InvalidConstraint(ValueError):
    """The caller's constraint is malformed. `param` names the request field, `where` the place in it,
    `code` the error code when there is one more precise than the status (e.g. a limit's name)."""

    def __init__(self, message: str, *, param: str, where: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.where = where
        self.code = code


def json_pointer(path: Any) -> str:
    parts = [str(p).replace("~", "~0").replace("/", "~1") for p in path]
    return "/" + "/".join(parts) if parts else "/"


class _PassedSchemas:
    """Digests of schemas that passed `check_schema`, least recently used first. Clients send the same
    schema with request after request; checking it against the meta-schema each time was most of the
    request preparation's CPU at concurrency 8 (py-spy), taken from the second core the engine shares."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._digests: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()

    def seen(self, digest: bytes) -> bool:
        with self._lock:
            if digest in self._digests:
                self._digests.move_to_end(digest)
                return True
            return False

    def add(self, digest: bytes) -> None:
        with self._lock:
            self._digests[digest] = None
            if len(self._digests) > self._capacity:
                self._digests.popitem(last=False)


_PASSED = _PassedSchemas(4096)


def check_schema(schema: Any, *, param: str) -> None:
    """Reject a schema that is not valid JSON Schema (Draft 2020-12 meta-schema), naming where. A schema
    that passed before (same canonical text) is not checked again; failures are never remembered, so each
    names its own request's field."""
    if not isinstance(schema, (dict, bool)):
        raise InvalidConstraint(
            f"{param} must be a JSON Schema object, got {type(schema).__name__}", param=param, where="/"
        )
    try:
        digest = hashlib.blake2b(canonical_json(schema).encode(), digest_size=16).digest()
    except RecursionError as exc:  # the depth limit (corral/grammars/limits.py) keeps callers from getting here
        raise InvalidConstraint(f"{param} nests too deeply to check", param=param, code="schema_too_deep") from exc
    if _PASSED.seen(digest):
        return
    _check_schema_uncached(schema, param)
    _PASSED.add(digest)


def _check_schema_uncached(schema: dict[str, Any] | bool, param: str) -> None:
    validator_cls = jsonschema.validators.validator_for(schema, default=Draft202012Validator)
    try:
        validator_cls.check_schema(schema)  # type: ignore[arg-type]  # booleans are valid schemas
    except jsonschema.SchemaError as exc:
        where = json_pointer(exc.path)
        raise InvalidConstraint(f"invalid JSON Schema at {where}: {exc.message}", param=param, where=where) from exc
    except RecursionError as exc:  # the depth limit (corral/grammars/limits.py) keeps callers from getting here
        raise InvalidConstraint(
            f"{param} nests too deeply to check", param=param, code="schema_too_deep"
        ) from exc
    _check_refs_inside(schema, param)


def _check_refs_inside(schema: Any, param: str) -> None:
    """Every `$ref` must point into the document itself: corral never fetches a schema, and an engine or
    the full check that met an unresolvable reference mid-answer could only fail the request late.
    (No JSONSchemaBench schema refers outside itself.)"""
    if not isinstance(schema, dict):
        return
    root_id = schema.get("$id")
    root: str = root_id if isinstance(root_id, str) else ""
    ids: set[str] = set()
    external: list[str] = []
    for node in objects_in(schema):
        node_id = node.get("$id")
        if isinstance(node_id, str):
            ids.add(urljoin(root, urldefrag(node_id)[0]))
        ref = node.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            external.append(ref)
    for ref in external:
        if urljoin(root, urldefrag(ref)[0]) not in ids:
            raise InvalidConstraint(
                f"{param} has a $ref to {ref[:200]!r}, outside the schema; corral resolves references only "
                "within the document (put the target under $defs)",
                param=param,
                code="unresolvable_ref",
            )


def check_regex_hint(pattern: str) -> str | None:
    """Python's view of a regex, for a position hint when every engine refuses it."""
    try:
        re.compile(pattern)
    except re.error as exc:
        return f"{exc.msg} at position {exc.pos}"
    return None


@dataclass(frozen=True)
class OutputCheck:
    valid: bool
    error: str | None = None
    value: Any = None


def schema_error(schema: dict[str, Any] | bool, value: Any) -> str | None:
    """Where `value` breaks the full `schema` (jsonschema + format checker), or None when it holds."""
    validator_cls = jsonschema.validators.validator_for(schema, default=Draft202012Validator)
    validator = validator_cls(schema, format_checker=FORMAT_CHECKER)
    error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    return None if error is None else f"at {json_pointer(error.absolute_path)}: {error.message}"
