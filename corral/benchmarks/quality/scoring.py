"""Judging one answer against its item's truth. Pure: no HTTP, no server.

The same judge serves every mode, so a constrained answer and a free-text one are read alike: the answer's
value is the first JSON value in its text (a bare label for `choice`, the first call for tools). It is
**parsed** when such a value is found, **valid** when it passes the task's JSON Schema (Draft 2020-12 with the
format checker) as it stands, and each scored **field** is right when it equals the truth up to the
comparison the field names (case and spacing for text, numerically for numbers), so accuracy measures the
content and validity the shape."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match

from corral.benchmarks.quality.tasks import Compare, Field, Item, Task
from corral.grammars.formats import FORMAT_CHECKER

NUMBER_TOLERANCE = 0.005  # amounts are cents: 1250.5 and 1250.50 are one value
_WORD = re.compile(r"[A-Za-z]+")
_DIGITS = re.compile(r"\D")
_validators: dict[str, Draft202012Validator] = {}


@dataclass(frozen=True)
class Verdict:
    parsed: bool
    valid: bool
    fields: dict[str, bool] = field(default_factory=dict)
    value: Any = None
    error: str | None = None  # why the answer did not parse, or the schema's complaint
    overlong: bool = False  # an array holds more entries than the truth's: the model repeated items

    @property
    def exact(self) -> bool:
        return self.parsed and bool(self.fields) and all(self.fields.values())

    @property
    def field_accuracy(self) -> float:
        return sum(self.fields.values()) / len(self.fields) if self.fields else 0.0


def first_json_value(text: str) -> tuple[bool, Any]:
    """(found, value): the first object or array in `text` that parses as JSON. Text before it is skipped, as
    is a bracketed span that is not JSON; a value still open at the end of the text (an answer cut by the
    budget) ends the search, since everything after its start lies inside it."""
    start = 0
    while True:
        starts = [p for p in (text.find("{", start), text.find("[", start)) if p >= 0]
        if not starts:
            return False, None
        begin = min(starts)
        end = _balanced_end(text, begin)
        if end is None:
            return False, None
        try:
            return True, json.loads(text[begin:end])
        except ValueError:
            start = begin + 1


def _balanced_end(text: str, begin: int) -> int | None:
    """The index just past the bracket that closes the one at `begin` (strings and escapes respected)."""
    depth, in_string, escaped = 0, False, False
    for i in range(begin, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def schema_error(schema: dict[str, Any], value: Any) -> str | None:
    """None when `value` validates against `schema` (Draft 2020-12, formats checked), else the best error."""
    key = json.dumps(schema, sort_keys=True)
    validator = _validators.get(key)
    if validator is None:
        validator = _validators[key] = Draft202012Validator(schema, format_checker=FORMAT_CHECKER)
    error = best_match(validator.iter_errors(value))
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path)
    return f"{error.message} (at /{where})"


# -- comparing a field with the truth ----------------------------------------------------------------------
def _text(value: Any) -> str:
    return " ".join(str(value).split()).casefold().rstrip(".")


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip().replace(",", "").lstrip("$€£"))
        except ValueError:
            return None
    return None


def _singular(name: Any) -> str:
    text = _text(name)
    return text[:-1] if text.endswith("s") and len(text) > 3 else text


def _scalar(value: Any) -> bool:
    return isinstance(value, str | int | float) and not isinstance(value, bool)


def _same_records(keys: tuple[Field, ...], truth: Any, value: Any) -> bool:
    """Whether `value` holds the truth's records and no others, in any order: a one-to-one pairing in which
    each pair agrees on every key of `keys`. Greedy pairing is enough, since each key's comparison is an
    equivalence (up to the numbers' tolerance)."""
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value) or len(value) != len(truth):
        return False
    left = list(value)
    for want in truth:
        match = next((r for r in left if all(k.name in r and same(k.compare, want[k.name], r[k.name], k.keys)
                                             for k in keys)), None)
        if match is None:
            return False
        left.remove(match)
    return True


ORDER_LINE = (Field("name", "noun"), Field("qty", "number"))


def same(compare: Compare, truth: Any, value: Any, keys: tuple[Field, ...] = ()) -> bool:
    """Whether `value` equals the truth up to the comparison named (`keys`: a "records" field's keys)."""
    if compare == "number":
        number = _number(value)
        return number is not None and abs(number - float(truth)) <= NUMBER_TOLERANCE
    if compare == "label":
        return isinstance(value, str) and value.strip().casefold() == str(truth).casefold()
    if compare == "items":
        return _same_records(ORDER_LINE, truth, value)
    if compare == "records":
        return _same_records(keys, truth, value)
    if not _scalar(value):
        return False
    if compare == "digits":
        return _DIGITS.sub("", str(value)) == _DIGITS.sub("", str(truth))
    if compare == "noun":
        return _singular(value) == _singular(truth)
    return _text(value) == _text(truth)


def _at(value: Any, path: str) -> tuple[bool, Any]:
    """(found, leaf): the value at a dotted path through nested objects."""
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            return False, None
        value = value[key]
    return True, value


def _field_verdicts(task: Task, item: Item, truth: dict[str, Any], value: Any) -> dict[str, bool]:
    """Each scored field the truth has (a call: its own arguments), right or not; a leaf missing from the
    answer, or under a parent that is not an object, is wrong."""
    verdicts = {}
    for f in task.scored_fields(item):
        known, want = _at(truth, f.name)
        if known:
            found, got = _at(value, f.name)
            verdicts[f.name] = found and same(f.compare, want, got, f.keys)
    return verdicts


def _unparsed(task: Task, item: Item, error: str) -> Verdict:
    return Verdict(False, False, {f.name: False for f in task.scored_fields(item)}, error=error)


# -- one answer ---------------------------------------------------------------------------------------------
def score(task: Task, item: Item, content: str | None, tool_calls: list[Any] | None = None) -> Verdict:
    """An answer's verdict: `content` is the answer's text (a completion's `text`, a message's `content`),
    `tool_calls` a message's calls."""
    if task.kind == "tool":
        return score_tool(task, item, content, tool_calls)
    if task.kind == "choice":
        return score_choice(task, item, content or "")
    return score_json(task, item, content or "")


def score_json(task: Task, item: Item, text: str) -> Verdict:
    found, value = first_json_value(text)
    if not found:
        return _unparsed(task, item, "no complete JSON value in the answer")
    truth = item.truth
    overlong = isinstance(value, dict) and any(
        isinstance(v, list) and isinstance(value.get(k), list) and len(value[k]) > len(v) for k, v in truth.items())
    error = schema_error(task.schema, value)
    return Verdict(True, error is None, _field_verdicts(task, item, truth, value), value, error, overlong)


def score_choice(task: Task, item: Item, text: str) -> Verdict:
    """A label: the answer as it stands must be one of the labels to be valid (a JSON string, as a peer
    asked through response_format returns it, counts as its content); its first word is compared."""
    raw = text.strip()
    if raw.startswith('"'):
        try:
            decoded = json.loads(raw)
            raw = decoded if isinstance(decoded, str) else raw
        except ValueError:
            pass
    word = _WORD.search(raw)
    if word is None:
        return _unparsed(task, item, "no word in the answer")
    value = word.group(0).casefold()
    valid = raw in task.labels
    return Verdict(True, valid, {"label": value == item.truth}, value,
                   None if valid else f"{raw[:40]!r} is not one of {', '.join(task.labels)}")


def score_tool(task: Task, item: Item, content: str | None, tool_calls: list[Any] | None) -> Verdict:
    """The first call: from `tool_calls` (its `arguments` a JSON string, as OpenAI's shape has it), else the
    first JSON value of the text as {"name", "parameters" | "arguments"} (the format the prompt shows)."""
    name: Any = None
    arguments: Any = None
    if tool_calls:
        function = (tool_calls[0] or {}).get("function") or {}
        name, raw = function.get("name"), function.get("arguments")
        arguments = _loads(raw) if isinstance(raw, str) else None
    else:
        found, value = first_json_value(content or "")
        if found and isinstance(value, dict):
            name = value.get("name")
            raw = value.get("parameters", value.get("arguments"))
            arguments = _loads(raw) if isinstance(raw, str) else raw
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return _unparsed(task, item, "no call with a name and an arguments object in the answer")
    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in task.tools}.get(name)
    error = f"no function named {name!r}" if parameters is None else schema_error(parameters, arguments)
    truth = {"name": item.truth["name"], **item.truth["arguments"]}
    fields = _field_verdicts(task, item, truth, {**arguments, "name": name})
    return Verdict(True, error is None, fields, {"name": name, "arguments": arguments}, error)


def _loads(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None
