"""corral/benchmarks/serve/regex_gbnf.py: a regex written as llama.cpp's GBNF, for holding llama-server to the
same regexes as corral in `corral bench serve --kinds regex --peer-constraint grammar`. llama-server is not run
here; the expected rules follow llama.cpp's grammar syntax (src/llama-grammar.cpp), and the grammar-level check
below walks each rule with a small matcher of that syntax's subset."""

from __future__ import annotations

import re

import pytest

from corral.benchmarks.kinds.cases import CASES
from corral.benchmarks.serve.regex_gbnf import regex_to_gbnf
from corral.grammars.spec import GrammarKind

REGEXES = [c.spec.source for c in CASES if c.spec.kind is GrammarKind.REGEX]


@pytest.mark.parametrize(("regex", "rule"), [
    (r"[0-9]{4}-[0-9]{2}", '[0-9]{4} "-" [0-9]{2}'),
    (r"\+?[0-9]{1,3} \(x\)", '("+")? [0-9]{1,3} " (x)"'),
    (r"(yes|no)-\d+", '(("yes" | "no")) "-" [0-9]+'),
    (r"([a-z]{2,6} ){30}[a-z]*", '([a-z]{2,6} " "){30} [a-z]*'),
    (r"[a-z0-9._%+-]+@\S{2,}\.", '[a-z0-9._%+\\-]+ "@" [^ \\t\\n\\r\\x0C\\x0B]{2,} "."'),
    (r'^a"b\\c.$', '"a\\"b\\\\c" [^\\n]'),
    (r"[\^\]x]", "[\\x5E\\]x]"),
])
def test_each_regex_feature_has_its_gbnf_form(regex: str, rule: str) -> None:
    assert regex_to_gbnf(regex) == f"root ::= {rule}\n"


def test_every_built_in_regex_of_the_kinds_bench_converts() -> None:
    assert REGEXES
    for regex in REGEXES:
        assert regex_to_gbnf(regex).startswith("root ::= ")


@pytest.mark.parametrize("regex", [r"(a)\1", r"a(?=b)", r"(?<!x)y"])
def test_what_gbnf_cannot_say_is_refused_by_name(regex: str) -> None:
    with pytest.raises(ValueError, match="GBNF form here"):
        regex_to_gbnf(regex)


def test_the_gbnf_and_the_regex_accept_the_same_strings() -> None:
    """The rule turned back into a Python regex (GBNF's subset used here maps one to one) accepts and refuses what
    the original does, over each built-in case's example answer and a few near misses."""
    for case in [c for c in CASES if c.spec.kind is GrammarKind.REGEX]:
        back = _gbnf_to_regex(regex_to_gbnf(case.spec.source))
        for text in (case.text, case.text + "x", case.text[:-1], ""):
            assert bool(re.fullmatch(back, text)) == bool(re.fullmatch(case.spec.source, text)), (case.label, text)


def _gbnf_to_regex(gbnf: str) -> str:
    """The rule's right-hand side as a Python regex: quoted literals escaped, classes and operators kept."""
    body = gbnf.removeprefix("root ::= ").rstrip("\n")
    out, i = [], 0
    while i < len(body):
        char = body[i]
        if char == '"':
            j, literal = i + 1, []
            while body[j] != '"':
                if body[j] == "\\":
                    unescaped = {"n": "\n", "t": "\t", "r": "\r"}
                    literal.append(unescaped.get(body[j + 1], body[j + 1]))
                    j += 2
                else:
                    literal.append(body[j])
                    j += 1
            out.append("(?:" + re.escape("".join(literal)) + ")")
            i = j + 1
        elif char == "[":  # a class, copied as it is (its spaces are characters)
            j = i + 1
            while body[j] != "]":
                j += 2 if body[j] == "\\" else 1
            out.append(body[i : j + 1])
            i = j + 1
        elif char == "(":
            out.append("(?:")
            i += 1
        elif char == " ":
            i += 1
        else:
            out.append(char)
            i += 1
    return "".join(out)
