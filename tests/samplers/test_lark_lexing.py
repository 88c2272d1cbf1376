"""Lark grammars `auto` may give llguidance (corral/grammars/lark_lexing.py): the check proves greedy lexing exact only
where it is, and where it does, the two engines allow the very same tokens at every step of random answers."""

from __future__ import annotations

import random

import numpy as np
import pytest
from conftest import family_tokenizer

from corral.benchmarks.kinds.cases import CSV_LARK, SQL_LARK
from corral.grammar_engines.bitmask import allowed_ids
from corral.grammar_engines.protocol import Matcher, TokenizerSpec, allocate_bitmask
from corral.grammar_engines.registry import BackendSet
from corral.grammars.features import route
from corral.grammars.lark_lexing import greedy_lexing_exact, wide_and_exact
from corral.grammars.spec import GrammarSpec

WORDS = 'start: WORD (" " WORD)*\nWORD: /[a-z]{2,12}/\n'
PAIRS = 'start: pair (";" pair)*\npair: KEY "=" VALUE\nKEY: /[a-z_]{1,10}/\nVALUE: /[0-9]{1,4}/ | /\'[a-z ]{0,20}\'/\n'
KEYWORDS = 'start: ("SELECT" | "SHOW") " " /[a-z]{1,10}/\n'  # two strings sharing a first letter, neither a prefix


@pytest.mark.parametrize("source", [CSV_LARK, WORDS, PAIRS, KEYWORDS])
def test_grammars_whose_terminals_cannot_run_into_each_other_are_proved(source: str) -> None:
    assert greedy_lexing_exact(source)
    assert wide_and_exact(source)


@pytest.mark.parametrize(
    ("source", "why"),
    [
        ('start: x "ab"\nx: "a"*\n', "`a` and `ab` may both come next, and one starts the other"),
        ('start: WORD "b"\nWORD: /[a-z]+/\n', "`b` could go on the word: greedy lexing refuses `aab`"),
        ('start: "x" NAME\nNAME: /[a-z]{1,9}/\n%import common.WS\n%ignore WS\n', "spaces may come anywhere"),
        ('start: X "a"\nX: /b*/\n', "a terminal that matches the empty text"),
        ('start: /.{1,20}/ ";"\n', "`.`: a newline under xgrammar, not under llguidance"),
        ('start: /\\w+/\n', "`\\w`: ASCII under xgrammar, Unicode under llguidance"),
        ('start: /[a-z]+/i ";"\n', "a flag"),
        ('start: /[a-z]+(?=x)/ "x"\n', "a look-ahead"),
        ('start: %json {"type": "object"}\n', "llguidance's own extension: Lark's loader refuses it"),
        ('start: (\n', "not a grammar"),
        (SQL_LARK, "` `, ` FROM ` and ` WHERE ` may all follow a name, as far as the check can tell"),
    ],
)
def test_what_the_check_cannot_prove_stays_with_xgrammar(source: str, why: str) -> None:
    assert not greedy_lexing_exact(source), why
    assert route(GrammarSpec.lark(source), ["xgrammar", "llguidance"])[0] == "xgrammar"


@pytest.mark.parametrize(
    "source",
    [
        "start: " + " ".join(f'"a{i}"?' for i in range(40)),  # Lark writes out 2^40 alternatives
        "start: " + " ".join(f'("a{i}" | "b{i}")' for i in range(40)),
        'start: ("a" ~ 0..50) ~ 0..50',
        "start: A0\n" + "".join(f"A{i}: A{i + 1} A{i + 1}\n" for i in range(30)) + 'A30: "x"\n',  # copied 2^30 times
    ],
)
def test_grammars_lark_would_write_out_exponentially_are_left_unproven_before_it_does(source: str) -> None:
    """The check runs on the request's path: what Lark's loader or compile would blow up is counted first."""
    assert not greedy_lexing_exact(source)
    assert route(GrammarSpec.lark(source), ["xgrammar", "llguidance"])[0] == "xgrammar"


def test_auto_sends_wide_proved_grammars_to_llguidance_and_narrow_ones_to_xgrammar() -> None:
    assert route(GrammarSpec.lark(CSV_LARK), ["xgrammar", "llguidance"]) == ["llguidance", "xgrammar"]
    narrow = 'start: "id=" NUM\nNUM: /[0-9]{1,3}/\n'  # proved, but both engines fill it in 10-40 us
    assert greedy_lexing_exact(narrow) and not wide_and_exact(narrow)
    assert route(GrammarSpec.lark(narrow), ["xgrammar", "llguidance"])[0] == "xgrammar"
    assert route(GrammarSpec.ebnf('root ::= [a-z]+ ("," [a-z]+)*'), ["xgrammar", "llguidance"])[0] == "xgrammar"


def _allowed(matcher: Matcher, vocab_size: int, stops: list[int]) -> np.ndarray:
    """The matcher's mask as a boolean per token, stop tokens cleared."""
    bitmask = allocate_bitmask(1, vocab_size)
    bitmask.zero_()
    matcher.fill_bitmask(bitmask, 0)
    allowed = np.zeros(vocab_size, dtype=bool)
    allowed[allowed_ids(bitmask.numpy()[0], vocab_size)] = True
    allowed[stops] = False
    return allowed


@pytest.fixture(scope="module")
def backends() -> BackendSet:
    spec = family_tokenizer("corral-tiny")
    assert isinstance(spec, TokenizerSpec)
    return BackendSet(spec, ["xgrammar", "llguidance"])


@pytest.mark.parametrize(("source", "same_tokens"), [(CSV_LARK, True), (WORDS, True), (PAIRS, True), (KEYWORDS, False)])
def test_where_the_check_proves_it_both_engines_allow_the_same_answers(
    source: str, same_tokens: bool, backends: BackendSet
) -> None:
    """Random answers, each token drawn from what llguidance allows: at every step xgrammar (the CFG) allows it
    too, and allows nothing more, except where llguidance spells a string's forced rest in one token: after
    `SH` of `SHOW` it allows `OW`, not `O` (its own rule, for regexes as much; the text is the same)."""
    spec = GrammarSpec.lark(source)
    engines = [backends.get(name) for name in ("xgrammar", "llguidance")]
    compiled = [engine.compile(spec) for engine in engines]
    vocab = backends.tokenizer.vocab_size
    stops = sorted(backends.tokenizer.stop_token_ids)
    rng = random.Random(0)
    for _ in range(4):
        matchers = [engine.new_matcher(c) for engine, c in zip(engines, compiled, strict=True)]
        for _ in range(32):
            cfg, greedy = (_allowed(m, vocab, stops) for m in matchers)
            extra, missing = np.flatnonzero(greedy & ~cfg), np.flatnonzero(cfg & ~greedy)
            assert not len(extra), f"llguidance allows what the grammar refuses: {extra[:5]}"
            if same_tokens:
                assert not len(missing), f"llguidance refuses what the grammar allows: {missing[:5]}"
            choices = np.flatnonzero(greedy)
            if not len(choices):
                break
            token = int(choices[rng.randrange(len(choices))])
            assert all(m.accept_token(token) for m in matchers)
        assert matchers[0].can_terminate() == matchers[1].can_terminate()


def test_the_check_is_right_to_refuse_a_grammar_greedy_lexing_reads_differently(backends: BackendSet) -> None:
    """`/[a-z]+/ "b"`: under llguidance the word swallows the `b`, so `aab` never ends; xgrammar ends it."""
    source = 'start: WORD "b"\nWORD: /[a-z]+/\n'
    endings = []
    for name in ("xgrammar", "llguidance"):
        engine = backends.get(name)
        matcher = engine.new_matcher(engine.compile(GrammarSpec.lark(source)))
        for token in backends.tokenizer.hf_tokenizer.encode("aab", add_special_tokens=False):
            assert matcher.accept_token(int(token))
        endings.append(matcher.can_terminate())
    assert endings == [True, False]
