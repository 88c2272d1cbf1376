"""Texts that match a schema's `pattern` (corral/structured/pattern_texts.py), which the closing search writes into a
string the grammar will not let end (Github_hard/o44202: `"AssociativeID"` with `f-[0-9]+` stalled)."""

from __future__ import annotations

import re

import pytest

from corral.grammars.spec import GrammarSpec
from corral.structured.pattern_texts import pattern_example, pattern_examples


@pytest.mark.parametrize(
    ("pattern", "example"),
    [
        ("f-[0-9]+", "f-0"),
        ("srn:type:file/[A-Za-z0-9-]+:[0-9]*", "srn:type:file/A:"),
        ("^CONFIDENTIAL|SECRET$", "SECRET"),  # the shortest alternative
        (r"^\d{4}-\d{2}$", "0000-00"),
        ("(foo|ab)+x", "abx"),
        (r"\w+@\w+\.com", "a@a.com"),
    ],
)
def test_the_shortest_text_the_pattern_is_found_in(pattern: str, example: str) -> None:
    assert pattern_example(pattern) == example
    assert re.search(pattern, example)


@pytest.mark.parametrize("pattern", ["(", "a{1000}", "[^a-z]{3}"])
def test_no_example_where_it_cannot_say(pattern: str) -> None:
    assert pattern_example(pattern) is None  # a broken regex, one too long to close with, a negated class


def test_a_spec_gives_each_pattern_once_escaped_for_a_json_string() -> None:
    schema = {"type": "object", "properties": {
        "a": {"type": "string", "pattern": 'q"[0-9]'},
        "b": {"type": "array", "items": {"type": "string", "pattern": 'q"[0-9]'}},
        "c": {"type": "string", "pattern": "x+"},
    }}
    assert pattern_examples(GrammarSpec.json_schema(schema)) == ('q\\"0', "x")
    assert pattern_examples(GrammarSpec.regex("f-[0-9]+")) == ()  # a regex constraint is no schema
