"""JSON whitespace modes (corral/grammars/spec.py GrammarSpec.whitespace, docs/constraints.md "JSON layout") on both
engines
and both tokenizer families: `fixed` keeps the one-line answer exactly; `free` lets the model keep its own layout,
pretty-printed included, with every gap between two tokens bounded so that it cannot loop on whitespace."""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import TOKENIZER_FAMILIES, family_tokenizer

from corral.grammar_engines.bitmask import allowed_ids
from corral.grammar_engines.llguidance_backend import JSON_OPTIONS
from corral.grammar_engines.protocol import CompiledGrammar, Matcher, SamplerBackend, TokenizerSpec, allocate_bitmask
from corral.grammar_engines.registry import BackendSet
from corral.grammars.contract import validate_output
from corral.grammars.spec import FREE_GAP_INDENT, FREE_GAP_NEWLINES, GrammarKind, GrammarSpec
from corral.structured.closing import ClosingVocabulary, required_keys, shortest_completion

BACKENDS = ["xgrammar", "llguidance"]

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
INSTANCE = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry"], "address": {"city": "London", "zip": "W1"}}
PRETTY = json.dumps(INSTANCE, indent=2)  # newlines, indent 2 and 4, `,` and `: ` as a model writes them
COMPACT = json.dumps(INSTANCE)  # `fixed`'s own layout: ", " and ": "
DENSE = json.dumps(INSTANCE, separators=(",", ":"))
LONGEST_GAP = "\n" * FREE_GAP_NEWLINES + " " * FREE_GAP_INDENT  # the longest gap `free` allows (llama.cpp's rule)


@pytest.fixture(scope="module", params=TOKENIZER_FAMILIES)
def tokenizer_spec(request: pytest.FixtureRequest) -> TokenizerSpec:
    spec = family_tokenizer(str(request.param))
    assert isinstance(spec, TokenizerSpec)
    return spec


@pytest.fixture(scope="module")
def backend_set(tokenizer_spec: TokenizerSpec) -> BackendSet:
    backends = BackendSet(tokenizer_spec, list(BACKENDS))
    backends.warm_up()
    return backends


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, backend_set: BackendSet) -> SamplerBackend:
    return backend_set.get(str(request.param))


def encode(tokenizer: TokenizerSpec, text: str) -> list[int]:
    return [int(t) for t in tokenizer.hf_tokenizer.encode(text, add_special_tokens=False)]


@functools.cache  # a compile is ~0.6 s on Gemma's vocabulary; a test takes a fresh matcher of the same grammar
def _compiled(backend: SamplerBackend, spec: GrammarSpec) -> CompiledGrammar:
    return backend.compile(spec)


def matcher_for(backend: SamplerBackend, spec: GrammarSpec) -> Matcher:
    return backend.new_matcher(_compiled(backend, spec))


@pytest.fixture(autouse=True, scope="module")
def _forget_compiles() -> Iterator[None]:
    """The cache holds the backends (and their vocabulary tables): it goes with the module."""
    yield
    _compiled.cache_clear()


def free(spec: GrammarSpec) -> GrammarSpec:
    return spec.with_whitespace("free")


def takes(matcher: Matcher, tokenizer: TokenizerSpec, text: str) -> bool:
    """Whether `matcher` accepts `text` token by token and may end after it."""
    for token in encode(tokenizer, text):
        if not matcher.accept_token(token):
            return False
    return matcher.can_terminate()


def accepts(backend: SamplerBackend, spec: GrammarSpec, tokenizer: TokenizerSpec, text: str) -> bool:
    return takes(matcher_for(backend, spec), tokenizer, text)


# -- the spec ------------------------------------------------------------------------------------------------------

def test_the_mode_is_part_of_the_key_and_applies_to_json_kinds_only() -> None:
    spec = GrammarSpec.json_schema(SCHEMA)
    assert spec.whitespace == "fixed" and spec.with_whitespace("fixed") == spec
    assert free(spec).key == spec.key + ":whitespace_free"  # compiled and cached apart; `fixed` keys as before
    assert free(GrammarSpec.json_object()).whitespace == "free"
    assert free(GrammarSpec.regex("a+")) == GrammarSpec.regex("a+")  # exact kinds say what the text is
    assert free(GrammarSpec(GrammarKind.TOOL_CALLS, "{}")).whitespace == "fixed"  # tool calls keep their format
    assert free(spec).relaxed().whitespace == "free"  # the decode-safe profile keeps the layout
    with pytest.raises(ValueError, match="fixed, free"):
        spec.with_whitespace("loose")


# -- fixed: today's answer, exactly -----------------------------------------------------------------------------

def test_fixed_compiles_as_before(backend_set: BackendSet) -> None:
    """The default spec gets the same engine input as before the option existed (byte for byte)."""
    import llguidance
    import xgrammar

    spec = GrammarSpec.json_schema(SCHEMA)
    xgr: Any = backend_set.get("xgrammar")
    before = xgrammar.Grammar.from_json_schema(spec.source, any_whitespace=False, strict_mode=False)
    assert str(xgr._grammar(spec)) == str(before)
    llg: Any = backend_set.get("llguidance")
    assert llg._grammar_text(spec) == str(llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), defaults=JSON_OPTIONS))


def test_fixed_takes_only_its_one_line_layout(backend: SamplerBackend, tokenizer_spec: TokenizerSpec) -> None:
    spec = GrammarSpec.json_schema(SCHEMA)
    assert accepts(backend, spec, tokenizer_spec, COMPACT)
    for other in (PRETTY, DENSE, COMPACT.replace(", ", ",\n")):
        assert not accepts(backend, spec, tokenizer_spec, other), other


# -- free: the model's layout, bounded -------------------------------------------------------------------------

@pytest.mark.parametrize(("lead", "relaxed"), [(False, False), (True, False), (False, True)])
def test_free_takes_a_pretty_printed_answer_token_by_token(
    backend: SamplerBackend, tokenizer_spec: TokenizerSpec, lead: bool, relaxed: bool
) -> None:
    spec = free(GrammarSpec.json_schema(SCHEMA)).with_leading_whitespace(lead)
    spec = spec.relaxed() if relaxed else spec  # `auto`'s decode-safe profile keeps the layout too
    matcher = matcher_for(backend, spec)
    text = (" " if lead else "") + PRETTY
    for token in encode(tokenizer_spec, text):
        assert not matcher.can_terminate()
        assert matcher.accept_token(token), repr(tokenizer_spec.hf_tokenizer.decode([token]))
    assert matcher.error is None and matcher.can_terminate()


@pytest.mark.parametrize("text", [COMPACT, DENSE, json.dumps(INSTANCE, indent="\t"), json.dumps(INSTANCE, indent=4)])
def test_free_takes_the_other_usual_layouts(backend: SamplerBackend, tokenizer_spec: TokenizerSpec, text: str) -> None:
    assert accepts(backend, free(GrammarSpec.json_schema(SCHEMA)), tokenizer_spec, text)


def test_free_json_object_takes_a_pretty_printed_object(backend: SamplerBackend, tokenizer_spec: TokenizerSpec) -> None:
    assert accepts(backend, free(GrammarSpec.json_object()), tokenizer_spec, PRETTY)
    assert not accepts(backend, GrammarSpec.json_object(), tokenizer_spec, PRETTY)


def test_free_still_keeps_the_schema_and_starts_at_the_value(
    backend: SamplerBackend, tokenizer_spec: TokenizerSpec
) -> None:
    spec = free(GrammarSpec.json_schema(SCHEMA))
    assert not accepts(backend, spec, tokenizer_spec, PRETTY.replace("36", '"36"'))
    assert not accepts(backend, spec, tokenizer_spec, "\n" + PRETTY)  # before the value: json_leading_whitespace's
    assert not accepts(backend, spec, tokenizer_spec, PRETTY + "\n")  # and nothing after it


@pytest.mark.parametrize(("before", "after"), [
    ("{", '"name"'), ('{"name"', ":"), ('{"name":', '"Ada"'), ('{"name": "Ada",', '"age"'),
    ('{"name": "Ada", "age": 36, "tags": [', "]"), ('{"name": "Ada", "age": 36', ","),
])
def test_free_gaps_are_bounded(backend: SamplerBackend, tokenizer_spec: TokenizerSpec, before: str, after: str) -> None:
    """Wherever a gap may be, the longest llama.cpp allows is taken and one character more is not, nor 30 spaces,
    newlines or tabs in a row."""
    spec = free(GrammarSpec.json_schema(SCHEMA))
    for gap, ok in [("", True), (LONGEST_GAP, True), (LONGEST_GAP + " ", False), (" " * 30, False),
                    ("\n" * 30, False), ("\t" * 30, False)]:
        matcher = matcher_for(backend, spec)
        tokens = encode(tokenizer_spec, before + gap + after)
        taken = matcher.validate_tokens(tokens)
        assert (taken == len(tokens)) is ok, (repr(gap), tokenizer_spec.hf_tokenizer.decode(tokens[:taken]))


def test_llguidance_gaps_have_llama_cpp_s_shape(backend_set: BackendSet, tokenizer_spec: TokenizerSpec) -> None:
    """One skip per gap: a single space, or newlines then an indent; not two spaces, nor a third newline, nor a
    newline after spaces (xgrammar takes these: it bounds a gap by length only)."""
    spec = free(GrammarSpec.json_schema(SCHEMA))
    llguidance = backend_set.get("llguidance")
    for gap, ok in [(" ", True), ("\n\t\t", True), ("\n\n    ", True), ("  ", False), ("\n\n\n", False),
                    ("  \n", False), ("\n  \n  ", False), ("\r\n", False)]:
        tokens = encode(tokenizer_spec, "{" + gap + '"name"')
        assert (matcher_for(llguidance, spec).validate_tokens(tokens) == len(tokens)) is ok, repr(gap)


@functools.cache
def _whitespace_tokens(tokenizer: TokenizerSpec) -> frozenset[int]:
    """Ids whose text is whitespace only (JSON's four characters)."""
    hf = tokenizer.hf_tokenizer
    texts = hf.batch_decode([[i] for i in range(len(hf))])
    return frozenset(i for i, text in enumerate(texts[: tokenizer.vocab_size]) if text and not text.strip(" \n\r\t"))


def test_free_masks_never_allow_whitespace_forever(backend: SamplerBackend, tokenizer_spec: TokenizerSpec) -> None:
    """A model that always picks whitespace when the mask allows any: random walks over the whitespace tokens
    each mask allows, from inside an object, all come to a state whose mask allows none, within one gap's
    bound (xgrammar counts characters, so its longest gap is as long as llama.cpp's, not its shape)."""
    spec = free(GrammarSpec.json_schema(SCHEMA))
    compiled = backend.compile(spec)
    spaces = _whitespace_tokens(tokenizer_spec)
    bitmask = allocate_bitmask(1, tokenizer_spec.vocab_size)
    rng = random.Random(7)
    longest = 0
    for walk in range(40):
        matcher = backend.new_matcher(compiled)
        assert all(matcher.accept_token(t) for t in encode(tokenizer_spec, '{"name": "Ada",'))
        written = ""
        while True:
            bitmask.fill_(0)
            with torch.inference_mode():
                matcher.fill_bitmask(bitmask, 0)
            allowed = sorted(spaces.intersection(int(t) for t in allowed_ids(bitmask.numpy()[0],
                                                                                tokenizer_spec.vocab_size)))
            if not allowed:
                break
            token = allowed[-1] if walk == 0 else rng.choice(allowed)  # the first walk: the last id (often longest)
            assert matcher.accept_token(token)
            written += tokenizer_spec.hf_tokenizer.decode([token])
            assert len(written) <= len(LONGEST_GAP), repr(written)
        longest = max(longest, len(written))
    assert longest >= FREE_GAP_NEWLINES + 1  # the walks did write whitespace


def test_free_answer_cut_short_still_closes(backend: SamplerBackend, tokenizer_spec: TokenizerSpec) -> None:
    """corral/structured/closing.py from inside a pretty-printed answer: the completion is accepted and the answer
    valid."""
    spec = free(GrammarSpec.json_schema(SCHEMA))
    compiled = backend.compile(spec)
    vocab = ClosingVocabulary.of(tokenizer_spec)
    tokens = encode(tokenizer_spec, PRETTY)
    for fraction in (0.2, 0.4, 0.6, 0.8, 0.95):
        cut = max(1, int(len(tokens) * fraction))
        matcher = backend.new_matcher(compiled)
        assert all(matcher.accept_token(t) for t in tokens[:cut])
        prefix = tokenizer_spec.hf_tokenizer.decode(tokens[:cut])
        plan = shortest_completion(matcher, vocab, 48, prefix=prefix, keys=required_keys(spec), deadline_s=2.0)
        assert plan is not None, prefix
        answer = prefix + tokenizer_spec.hf_tokenizer.decode(plan)
        assert validate_output(spec, answer).valid, answer
        assert all(matcher.accept_token(t) for t in plan) and matcher.can_terminate()
