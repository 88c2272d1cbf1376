"""Tool calls as a constraint: the text formats models are trained on, the spec, its Lark lowering, and
the parser that turns an answer back into calls (checked against each function's full schema).

An answer is either text (only when `mode` is `auto`) or one or more calls in the model family's format:

- `llama3_json` (Llama 3.1+): `{"name": "f", "parameters": {...}}`, parallel calls joined by `; `
- `hermes` (Hermes, Qwen): `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, one block per call
- `mistral`: `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`

The layout is fixed (no free whitespace, `, ` and `: ` separators as in corral's JSON), so a call's
arguments are exactly the text between its prefix and its closing characters.

A format's `markers` (`<tool_call>`, `</tool_call>`, `[TOOL_CALLS]`) are often single *special* tokens of the
model's vocabulary (Qwen 2.5, Hermes, Mistral), the token the model was trained to write. A backend that lets
a special token match only a token reference (llguidance) passes `to_lark` those tokens, which the grammar then
allows beside the spelled-out text; either way the answer's text holds the marker
(corral/grammar_engines/answer_text.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from corral.grammars.spec import GrammarKind, GrammarSpec
from corral.grammars.validation import OutputCheck, schema_error

Mode = Literal["auto", "required"]


@dataclass(frozen=True)
class ToolFormat:
    """How one model family writes calls: `begin call (separator call)* end`, a call being
    `{open}"NAME", "{args_key}": ARGS{close}`. `marker` opens every answer that calls a tool, so text
    answers (`auto`) may not start with it. `markers`: the pieces of its literals that a vocabulary may hold
    as one (special) token."""

    name: str
    begin: str
    open: str
    args_key: str
    close: str
    separator: str
    end: str
    marker: str
    markers: tuple[str, ...] = ()

    def prefix(self, tool: str) -> str:
        """Everything of a call before its arguments."""
        return f'{self.open}{json.dumps(tool)}, "{self.args_key}": '

    def render(self, calls: list[tuple[str, str]]) -> str:
        """The text of (name, arguments JSON text) calls, as the model would write them (chat history)."""
        body = self.separator.join(f"{self.prefix(name)}{args}{self.close}" for name, args in calls)
        return f"{self.begin}{body}{self.end}"


FORMATS: dict[str, ToolFormat] = {
    "llama3_json": ToolFormat("llama3_json", "", '{"name": ', "parameters", "}", "; ", "", '{"'),
    "hermes": ToolFormat(
        "hermes",
        "",
        '<tool_call>\n{"name": ',
        "arguments",
        "}\n</tool_call>",
        "\n",
        "",
        "<tool_call>",
        ("<tool_call>", "</tool_call>"),
    ),
    "mistral": ToolFormat(
        "mistral", "[TOOL_CALLS][", '{"name": ', "arguments", "}", ", ", "]", "[TOOL_CALLS]", ("[TOOL_CALLS]",)
    ),
}
DEFAULT_FORMAT = "llama3_json"
# Every format's markers: the special tokens an answer's text keeps (corral/grammar_engines/answer_text.py).
MARKERS = frozenset(marker for fmt in FORMATS.values() for marker in fmt.markers)


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ToolGrammar:
    """The decoded canonical source of a TOOL_CALLS spec."""

    format: ToolFormat
    mode: Mode
    tools: tuple[Tool, ...]
    parallel: bool
    text_schema: dict[str, Any] | None  # `auto` only: the text branch is JSON under this schema

    @classmethod
    def of(cls, spec: GrammarSpec) -> ToolGrammar:
        if spec.kind is not GrammarKind.TOOL_CALLS:
            raise ValueError(f"a {spec.kind} constraint is not a tool-call grammar")
        raw = json.loads(spec.source)
        return cls(
            FORMATS[raw["format"]],
            raw["mode"],
            tuple(Tool(t["name"], t["parameters"]) for t in raw["tools"]),
            bool(raw["parallel"]),
            raw.get("text"),
        )

    def tool(self, name: str) -> Tool | None:
        return next((t for t in self.tools if t.name == name), None)


def tool_calls_spec(
    tools: list[tuple[str, dict[str, Any]]],
    *,
    format: str = DEFAULT_FORMAT,
    mode: Mode = "required",
    parallel: bool = True,
    text_schema: dict[str, Any] | None = None,
) -> GrammarSpec:
    """The spec for calls to `tools` ((name, parameters schema) pairs, schemas already checked)."""
    if format not in FORMATS:
        raise ValueError(f"unknown tool-call format {format!r}; expected one of {', '.join(FORMATS)}")
    if not tools:
        raise ValueError("a tool-call grammar needs at least one tool")
    if mode not in ("auto", "required"):
        raise ValueError(f"tool-call mode must be auto or required, got {mode!r}")
    if text_schema is not None and mode != "auto":
        raise ValueError("only an `auto` tool-call grammar has a text branch")
    description: dict[str, Any] = {
        "format": format,
        "mode": mode,
        "tools": [{"name": name, "parameters": schema} for name, schema in tools],
        "parallel": parallel,
    }
    if text_schema is not None:
        description["text"] = text_schema
    return GrammarSpec.tool_calls(description)


def tool_schemas(spec: GrammarSpec) -> list[dict[str, Any]]:
    """Every JSON Schema the spec's grammar embeds (for feature scans and routing)."""
    grammar = ToolGrammar.of(spec)
    schemas = [t.parameters for t in grammar.tools]
    return schemas + ([grammar.text_schema] if grammar.text_schema is not None else [])


# -- lowering --------------------------------------------------------------------------------------------------
def _regex_literal(text: str) -> str:
    return "".join(f"\\{c}" if c in _REGEX_META else c for c in text)


_REGEX_META = set("\\.^$|?*+()[]{}-")


def not_starting_with(marker: str) -> str:
    """A regex (Rust and xgrammar dialects alike) for any text that does not start with `marker`: the
    text branch of `auto`, so an answer that opens a call is a call, never text."""
    branches = [
        f"{_regex_literal(marker[:i])}(?:[^{_regex_literal(marker[i])}][\\s\\S]*)?" for i in range(len(marker))
    ]
    return "(?:" + "|".join(branches) + ")"


def lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # JSON escapes are valid Lark string escapes


def lark_text(text: str, tokens: Mapping[str, int]) -> str:
    """`text` as a Lark sequence in which each marker of `tokens` (marker text → id of the special token that
    spells it) is that token (`<[id]>`, llguidance's token reference) or the marker's text written out."""
    parts: list[str] = []
    rest = text
    while rest:
        found = [(rest.find(marker), marker) for marker in tokens if marker and marker in rest]
        if not found:
            parts.append(lark_string(rest))
            break
        at, marker = min(found, key=lambda hit: (hit[0], -len(hit[1])))
        if at:
            parts.append(lark_string(rest[:at]))
        parts.append(f"(<[{tokens[marker]}]> | {lark_string(marker)})")
        rest = rest[at + len(marker) :]
    return " ".join(parts)


def to_lark(grammar: ToolGrammar, json_options: dict[str, Any], tokens: Mapping[str, int] | None = None) -> str:
    """A Lark grammar (llguidance dialect: `%json{...}` embeds a JSON Schema) for the whole answer.
    `json_options` become each schema's `x-guidance` compile options (separators, whitespace, leniency).
    `tokens`: the format's markers that are single special tokens of the vocabulary, by text (`lark_text`)."""
    fmt = grammar.format
    special = tokens or {}
    lines = []
    names = []
    for index, tool in enumerate(grammar.tools):
        schema = {**tool.parameters, "x-guidance": json_options}
        prefix, close = lark_text(fmt.prefix(tool.name), special), lark_text(fmt.close, special)
        lines.append(f"call_{index}: {prefix} %json {json.dumps(schema)} {close}")
        names.append(f"call_{index}")
    lines.append(f"call: {' | '.join(names)}")
    repeat = f" ({lark_text(fmt.separator, special)} call)*" if grammar.parallel else ""
    begin = f"{lark_text(fmt.begin, special)} " if fmt.begin else ""
    end = f" {lark_text(fmt.end, special)}" if fmt.end else ""
    lines.append(f"calls: {begin}call{repeat}{end}")
    if grammar.mode == "required":
        lines.insert(0, "start: calls")
    elif grammar.text_schema is not None:
        lines.insert(0, "start: calls | text")
        lines.append(f"text: %json {json.dumps({**grammar.text_schema, 'x-guidance': json_options})}")
    else:
        lines.insert(0, "start: calls | TEXT")
        lines.append(f"TEXT: /{not_starting_with(fmt.marker)}/")
    return "\n".join(lines) + "\n"


# -- parsing ---------------------------------------------------------------------------------------------------
@dataclass
class ScannedCall:
    name: str
    arguments: str  # the arguments' JSON text (so far, while streaming)


@dataclass
class Scan:
    """What an answer (or the part generated so far) holds: text, or calls. Both empty while a partial
    answer could still become either."""

    content: str | None = None
    calls: list[ScannedCall] = field(default_factory=list)
    error: str | None = None


_DECODER = json.JSONDecoder()


def scan(grammar: ToolGrammar, text: str, *, final: bool = True) -> Scan:
    """Split `text` into content or calls. `final=False` reads a prefix of an answer still being
    generated: what cannot yet be decided is left out, never guessed."""
    fmt = grammar.format
    if grammar.mode == "auto" and grammar.text_schema is not None:
        # JSON text may start like a call: it is a call only if it reads as one.
        calls = _scan_calls(grammar, text, final)
        if calls.error is None and (calls.calls or not final):
            return calls
        return Scan(content=text)
    if grammar.mode == "auto" and not text.startswith(fmt.marker):
        if final:
            written = written_as_text(grammar, text)
            return Scan(calls=[written]) if written is not None else Scan(content=text)
        if fmt.marker.startswith(text) or _may_be_written_call(text):
            return Scan()  # a prefix of the marker, or of a call written as JSON text: not known yet
        return Scan(content=text)
    return _scan_calls(grammar, text, final)


_FENCE = re.compile(r"^```(?:json)?\s*\n(.*?)\n?```$", re.DOTALL)


def written_as_text(grammar: ToolGrammar, text: str) -> ScannedCall | None:
    """Under `auto`, an answer that is one call written as JSON text instead of in the format's markers — a
    ```json block or a bare object `{"name": TOOL, "arguments": {...}}`, as Qwen2.5-Coder 1.5B writes its calls
    unprompted (so does it through llama-server on the same file) — read as that call, when it names a known
    tool and its arguments hold under the tool's full schema. Anything else stays text."""
    body = text.strip()
    fenced = _FENCE.match(body)
    if fenced is not None:
        body = fenced.group(1).strip()
    if not body.startswith("{"):
        return None
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or set(value) not in ({"name", "arguments"}, {"name", "parameters"}):
        return None
    tool = grammar.tool(value["name"]) if isinstance(value["name"], str) else None
    arguments = value.get("arguments", value.get("parameters"))
    if tool is None or not isinstance(arguments, dict) or schema_error(tool.parameters, arguments) is not None:
        return None
    return ScannedCall(tool.name, json.dumps(arguments, ensure_ascii=False))


def _may_be_written_call(text: str) -> bool:
    """Whether a streamed `auto` answer may still turn out to be a call written as JSON text (held back)."""
    head = text.lstrip()
    return head.startswith(("{", "```")) or (bool(head) and "```".startswith(head))


def _scan_calls(grammar: ToolGrammar, text: str, final: bool) -> Scan:
    fmt = grammar.format
    result = Scan()
    pos = _expect(text, 0, fmt.begin, final)
    if pos is None:
        return _fail(result, final, f"the answer does not start with {fmt.begin!r}")
    while True:
        if pos == len(text) and not final:
            return result
        head = next((t.name for t in grammar.tools if text.startswith(fmt.prefix(t.name), pos)), None)
        if head is None:
            partial = any(fmt.prefix(t.name).startswith(text[pos:]) for t in grammar.tools)
            return _fail(result, final or not partial, f"no call to a known tool at offset {pos}")
        pos += len(fmt.prefix(head))
        try:
            _, args_end = _DECODER.raw_decode(text, pos)
        except json.JSONDecodeError:
            if final:
                return _fail(result, True, f"the arguments of call {len(result.calls) + 1} are not complete JSON")
            result.calls.append(ScannedCall(head, text[pos:]))
            return result
        result.calls.append(ScannedCall(head, text[pos:args_end]))
        after = _expect(text, args_end, fmt.close, final)
        if after is None:
            return _fail(result, True, f"call {len(result.calls)} is not closed")
        pos = after
        if pos == len(text):
            if final and fmt.end:
                return _fail(result, True, f"the answer does not end with {fmt.end!r}")
            return result
        if fmt.end and text[pos:] == fmt.end:
            return result
        nxt = _expect(text, pos, fmt.separator, final)
        if nxt is None:
            if not final and fmt.end and fmt.end.startswith(text[pos:]):
                return result
            return _fail(result, True, f"unexpected text after call {len(result.calls)}: {text[pos:pos + 20]!r}")
        pos = nxt


def _expect(text: str, pos: int, literal: str, final: bool) -> int | None:
    """Position after `literal` at `pos`; a partial read at the end of `text` counts as a match."""
    if text.startswith(literal, pos):
        return pos + len(literal)
    rest = text[pos:]
    if not final and literal.startswith(rest):
        return len(text)
    return None


def _fail(result: Scan, fatal: bool, message: str) -> Scan:
    if fatal:
        result.error = message
    return result


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text, as generated
    value: Any  # the parsed arguments


@dataclass(frozen=True)
class ToolAnswer:
    content: str | None
    calls: tuple[ParsedCall, ...]


def validate_tool_answer(spec: GrammarSpec, text: str) -> OutputCheck:
    """The full contract of a tool-call answer: well-formed calls to known tools, each one's arguments
    valid under its full `parameters` schema; or, under `auto`, text (JSON under the text schema if any)."""
    grammar = ToolGrammar.of(spec)
    found = scan(grammar, text)
    if found.error is not None:
        return OutputCheck(False, found.error)
    if found.content is not None:
        if grammar.text_schema is not None:
            try:
                value = json.loads(found.content)
            except json.JSONDecodeError as exc:
                return OutputCheck(False, f"the text answer is not JSON: {exc}")
            error = schema_error(grammar.text_schema, value)
            if error is not None:
                return OutputCheck(False, f"the text answer, {error}")
        return OutputCheck(True, None, ToolAnswer(found.content, ()))
    if not found.calls:
        return OutputCheck(False, "no tool call in the answer")
    if len(found.calls) > 1 and not grammar.parallel:
        return OutputCheck(False, f"{len(found.calls)} calls, but parallel tool calls are off")
    parsed = []
    for index, call in enumerate(found.calls):
        tool = grammar.tool(call.name)
        assert tool is not None  # scan only reads known names
        value = json.loads(call.arguments)
        error = schema_error(tool.parameters, value)
        if error is not None:
            return OutputCheck(False, f"call {index + 1} ({call.name}): arguments {error}")
        parsed.append(ParsedCall(call.name, call.arguments, value))
    return OutputCheck(True, None, ToolAnswer(None, tuple(parsed)))
