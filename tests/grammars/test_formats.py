"""The IRI formats, which corral checks itself (corral/grammars/formats.py), and the import they spare."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from jsonschema import Draft4Validator, Draft7Validator, Draft202012Validator

from corral.grammars.contract import validate_output
from corral.grammars.formats import as_uri, format_checker, is_iri, is_iri_reference
from corral.grammars.spec import GrammarSpec

IRIS = [
    "https://example.com/ä",
    "http://例え.テスト/パス?クエリ=値#断片",
    "urn:isbn:0451450523",
    "mailto:josé@example.com",
    "https://example.com/search?q=\ue000",  # iprivate, allowed in the query
    "https://example.com/%C3%A4",
    "ftp://[2001:db8::1]/𝄞",  # a plane-1 ucschar
]
NOT_IRIS = [
    "not-an-iri",  # no scheme
    "https://example.com/a b",  # a space
    "https://example.com/\ue000",  # iprivate outside the query
    "https://example.com/#\ue000",  # nor in the fragment
    "https://example.com/\u0085",  # a C1 control
    "https://example.com/\ufffe",  # a noncharacter
    "ä://example.com",  # the scheme is ASCII only
    "https://example.com/%zz",  # a broken percent-escape
    "https://example.com/\U000e0001",  # plane 14 below U+E1000
]


@pytest.mark.parametrize("value", IRIS)
def test_iris_are_accepted(value: str) -> None:
    assert is_iri(value)
    assert is_iri_reference(value)


@pytest.mark.parametrize("value", NOT_IRIS)
def test_strings_that_are_not_iris_are_refused(value: str) -> None:
    assert not is_iri(value)


@pytest.mark.parametrize(("value", "valid"), [("/pfad/ä", True), ("../ü?x=\ue000", True), ("#frag", True),
                                              ("\ue000", False), ("a b", False), ("%zz", False)])
def test_iri_references(value: str, valid: bool) -> None:
    assert is_iri_reference(value) is valid
    assert not is_iri(value)  # none is absolute


def test_the_mapping_to_a_uri_percent_encodes_utf8() -> None:
    assert as_uri("https://example.com/ä?q=€") == "https://example.com/%C3%A4?q=%E2%82%AC"
    assert as_uri("https://example.com/\ue000") is None


def test_the_iri_formats_are_checked_where_the_draft_defines_them() -> None:
    schema = {"type": "string", "format": "iri"}
    assert not Draft7Validator(schema, format_checker=format_checker(Draft7Validator)).is_valid("not-an-iri")
    assert not Draft202012Validator(schema, format_checker=format_checker()).is_valid("not-an-iri")
    assert Draft4Validator(schema, format_checker=format_checker(Draft4Validator)).is_valid("not-an-iri")
    # jsonschema's other checks are all there
    assert not Draft202012Validator({"format": "uri"}, format_checker=format_checker()).is_valid("not a uri")


def test_answers_are_held_to_the_iri_reference_format() -> None:
    spec = GrammarSpec.json_schema({"type": "string", "format": "iri-reference"})
    assert validate_output(spec, json.dumps("../ü")).valid
    assert not validate_output(spec, json.dumps("a b")).valid


def test_importing_the_answer_check_builds_no_earley_parsers() -> None:
    """rfc3987-syntax builds 39 Earley parsers when jsonschema imports it (~2.3 s per process); corral does not
    install it, so nothing it imports pulls it in."""
    code = "import sys, corral.grammars.validation, corral.server.app; print('rfc3987_syntax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
