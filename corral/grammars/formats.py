"""The JSON Schema `format` checks corral holds answers to: jsonschema's, plus `iri` and `iri-reference`.

jsonschema checks the IRI formats only through rfc3987-syntax, which builds 39 Earley parsers when jsonschema is
imported (~2.3 s of every process that imports it: the server, each compile zygote and worker, each CLI run). corral
installs jsonschema's other format packages and checks IRIs here instead, by RFC 3987's own mapping (section 3.1):
an IRI is a URI in which unreserved characters may also be `ucschar` (and `iprivate` in the query); percent-encode
those as UTF-8 and the result must be a URI. On 20,000 random strings this gave rfc3987-syntax's verdicts, except
for characters beyond U+FFFF, which RFC 3987 allows and rfc3987-syntax refuses. Where rfc3987-syntax happens to be
installed, these checks win."""

from __future__ import annotations

from functools import cache
from urllib.parse import quote

from jsonschema import Draft7Validator, Draft201909Validator, Draft202012Validator, FormatChecker
from jsonschema.protocols import Validator
from rfc3986_validator import validate_rfc3986

# The drafts that define the IRI formats.
IRI_DRAFTS: tuple[type[Validator], ...] = (Draft7Validator, Draft201909Validator, Draft202012Validator)


def _plane_char(code: int) -> tuple[bool, bool]:
    """(ucschar, iprivate) for a code point above U+FFFF: RFC 3987 allows planes 1-14 (14 from U+E1000) and
    keeps 15-16 private, each without its last two code points."""
    plane, low = code >> 16, code & 0xFFFF
    if low > 0xFFFD:
        return False, False
    return (1 <= plane <= 13 or (plane == 14 and low >= 0x1000)), plane in (15, 16)


def _kind(char: str) -> str | None:
    """'ucs' or 'private' for a non-ASCII character an IRI may hold, None for one it may not."""
    code = ord(char)
    if code > 0xFFFF:
        ucs, private = _plane_char(code)
    else:
        ucs = 0xA0 <= code <= 0xD7FF or 0xF900 <= code <= 0xFDCF or 0xFDF0 <= code <= 0xFFEF
        private = 0xE000 <= code <= 0xF8FF
    return "ucs" if ucs else "private" if private else None


def as_uri(iri: str) -> str | None:
    """`iri` with its non-ASCII characters percent-encoded (RFC 3987, 3.1), or None when one of them may not
    stand where it does (a character outside `ucschar`, or `iprivate` outside the query)."""
    query = iri.find("?")
    fragment = iri.find("#")
    if fragment != -1 and query > fragment:
        query = -1  # a "?" in the fragment starts no query
    out = []
    for index, char in enumerate(iri):
        if char.isascii():
            out.append(char)
            continue
        kind = _kind(char)
        in_query = query != -1 and index > query and (fragment == -1 or index < fragment)
        if kind is None or (kind == "private" and not in_query):
            return None
        out.append(quote(char, safe=""))
    return "".join(out)


def _iri_as(rule: str, instance: object) -> bool:
    """Whether `instance` maps to a URI under rfc3986-validator's `rule` (non-strings pass, as jsonschema's do)."""
    if not isinstance(instance, str):
        return True
    uri = as_uri(instance)
    return uri is not None and bool(validate_rfc3986(uri, rule=rule))


def is_iri(instance: object) -> bool:
    return _iri_as("URI", instance)


def is_iri_reference(instance: object) -> bool:
    return _iri_as("URI_reference", instance)


@cache
def format_checker(validator_cls: type[Validator] = Draft202012Validator) -> FormatChecker:
    """`validator_cls`'s format checker, with the IRI formats where its draft defines them."""
    checker = FormatChecker(formats=())
    checker.checkers = dict(validator_cls.FORMAT_CHECKER.checkers)
    if validator_cls in IRI_DRAFTS:
        checker.checks("iri")(is_iri)
        checker.checks("iri-reference")(is_iri_reference)
    return checker


FORMAT_CHECKER = format_checker(Draft202012Validator)
