"""Tool-call formats: the spec, the answer parser (whole and streamed prefixes) and the full-contract check."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from corral.grammar_engines.registry import backend_traits
from corral.grammars.contract import validate_output
from corral.grammars.features import attempts, route
from corral.grammars.spec import GrammarKind
from corral.grammars.tools import FORMATS, ToolGrammar, not_starting_with, scan, to_lark, tool_calls_spec

WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [("get_weather", WEATHER), ("noop", {"type": "object", "properties": {}})]
CALLS = [("get_weather", '{"city": "Oslo", "days": 2}'), ("noop", "{}")]

TEXTS = {
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}; '
    '{"name": "noop", "parameters": {}}',
    "hermes": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'
    ),
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}, '
    '{"name": "noop", "arguments": {}}]',
}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_each_format_renders_and_reads_back_its_calls(fmt: str) -> None:
    assert FORMATS[fmt].render(CALLS) == TEXTS[fmt]
    spec = tool_calls_spec(TOOLS, format=fmt)
    check = validate_output(spec, TEXTS[fmt])
    assert check.valid, check.error
    assert [(c.name, c.arguments) for c in check.value.calls] == CALLS
    assert check.value.calls[0].value == {"city": "Oslo", "days": 2}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_every_prefix_of_an_answer_scans_without_error_and_never_runs_ahead(fmt: str) -> None:
    grammar = ToolGrammar.of(tool_calls_spec(TOOLS, format=fmt, mode="auto"))
    text = TEXTS[fmt]
    for end in range(len(text) + 1):
        found = scan(grammar, text[:end], final=False)
        assert found.error is None and found.content is None, (end, found)
        for call, (name, args) in zip(found.calls, CALLS, strict=False):
            assert call.name == name and args.startswith(call.arguments)


def test_arguments_that_break_the_schema_are_invalid() -> None:
    spec = tool_calls_spec(TOOLS)
    check = validate_output(spec, '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 0}}')
    assert not check.valid and "days" in str(check.error)


@pytest.mark.parametrize("text", [
    "",
    '{"name": "unknown", "parameters": {}}',
    '{"name": "noop", "parameters": {}',
    '{"name": "noop", "parameters": {}} trailing',
])
def test_malformed_answers_are_invalid(text: str) -> None:
    assert not validate_output(tool_calls_spec(TOOLS), text).valid


def test_two_calls_without_parallel_calls_are_invalid() -> None:
    assert not validate_output(tool_calls_spec(TOOLS, parallel=False), TEXTS["llama3_json"]).valid


def test_auto_reads_text_as_content_and_a_text_schema_applies_to_it() -> None:
    check = validate_output(tool_calls_spec(TOOLS, mode="auto"), "plain words")
    assert check.valid and check.value.content == "plain words" and not check.value.calls
    typed = tool_calls_spec(TOOLS, mode="auto", text_schema={"type": "object", "required": ["a"]})
    assert validate_output(typed, '{"a": 1}').valid
    assert not validate_output(typed, '{"b": 1}').valid


def test_a_partial_answer_that_could_still_be_either_is_undecided() -> None:
    grammar = ToolGrammar.of(tool_calls_spec(TOOLS, mode="auto", format="hermes"))
    assert scan(grammar, "<tool", final=False).content is None
    assert scan(grammar, "<toy", final=False).content == "<toy"


@pytest.mark.parametrize(
    "text",
    ['```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Oslo"\n  }\n}\n```',
     '{"name": "get_weather", "arguments": {"city": "Oslo"}}', '\n```\n{"name": "get_weather", "parameters": '
     '{"city": "Oslo"}}\n```\n'],
    ids=["fenced", "bare", "parameters"],
)
def test_under_auto_a_call_written_as_json_text_is_read_as_the_call(text: str) -> None:
    """Qwen2.5-Coder 1.5B writes its `auto` calls as a ```json block (through llama-server too): a known tool with
    arguments valid under its schema is that call, in the format's compact spelling."""
    check = validate_output(tool_calls_spec(TOOLS, mode="auto", format="hermes"), text)
    assert check.valid and check.value.content is None
    assert [(c.name, c.arguments) for c in check.value.calls] == [("get_weather", '{"city": "Oslo"}')]


@pytest.mark.parametrize(
    "text",
    ['```json\n{"name": "add", "arguments": {"a": 2}}\n```',  # no such tool
     '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 0}}',  # breaks the schema
     '{"name": "get_weather", "arguments": {"city": "Oslo"}, "note": 1}',  # more than a call
     '```python\nprint(1)\n```', '{"name": "get_weather"'],
)
def test_under_auto_json_text_that_is_not_a_valid_call_stays_text(text: str) -> None:
    check = validate_output(tool_calls_spec(TOOLS, mode="auto", format="hermes"), text)
    assert check.valid and check.value.content == text and not check.value.calls


def test_a_streamed_auto_answer_that_may_be_a_written_call_is_held_until_it_ends() -> None:
    grammar = ToolGrammar.of(tool_calls_spec(TOOLS, mode="auto", format="hermes"))
    for partial in ("`", "``", "```json\n{", '{"name": "get_'):
        assert scan(grammar, partial, final=False) == scan(grammar, "", final=False)  # nothing sent yet
    assert scan(grammar, "Sunny", final=False).content == "Sunny"
    typed = ToolGrammar.of(tool_calls_spec(TOOLS, mode="auto", text_schema={"type": "object"}))
    assert scan(typed, '{"name": "get_weather", "arguments": {"city": "Oslo"}}').content is not None  # JSON text


@pytest.mark.parametrize("marker", [fmt.marker for fmt in FORMATS.values()])
def test_text_branch_regex_refuses_exactly_what_starts_with_the_marker(marker: str) -> None:
    pattern = re.compile(not_starting_with(marker))
    for text in ["", "hi", marker[:-1], marker[:1] + "x", "x" + marker]:
        assert pattern.fullmatch(text), text
    assert not pattern.fullmatch(marker) and not pattern.fullmatch(marker + " more")


def test_lark_lowering_embeds_each_schema_with_the_json_options() -> None:
    grammar = ToolGrammar.of(tool_calls_spec(TOOLS, parallel=False))
    lark = to_lark(grammar, {"whitespace_flexible": False})
    assert lark.startswith("start: calls\n")
    assert '"x-guidance": {"whitespace_flexible": false}' in lark and "call_1" in lark
    assert '("; " call)*' not in lark


def test_spec_is_canonical_and_routes_like_json() -> None:
    spec = tool_calls_spec(TOOLS)
    assert spec.kind is GrammarKind.TOOL_CALLS and spec == tool_calls_spec(TOOLS)
    assert json.loads(spec.source)["tools"][0]["name"] == "get_weather"
    # The built-in backends' own traits decide the order (the registry's lookup, passed explicitly).
    assert route(spec, ["xgrammar", "llguidance"], backend_traits) == ["llguidance", "xgrammar"]
    assert [(name, s.decode_safe) for name, s in attempts(spec, ["llguidance"], backend_traits)] == [
        ("llguidance", False), ("llguidance", True)]


def test_bad_spec_arguments_are_refused() -> None:
    with pytest.raises(ValueError):
        tool_calls_spec([], format="hermes")
    with pytest.raises(ValueError):
        tool_calls_spec(TOOLS, format="nope")
    with pytest.raises(ValueError):
        tool_calls_spec(TOOLS, mode="required", text_schema={"type": "object"})
