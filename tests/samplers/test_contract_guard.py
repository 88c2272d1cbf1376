"""The contract guard under `auto`: an answer can end only where the whole JSON Schema holds."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from corral.grammar_engines.compilation import GrammarCache, GrammarRejected
from corral.grammar_engines.contract_guard import GuardedMatcher
from corral.grammar_engines.protocol import Matcher, SamplerBackend, TokenizerSpec, allocate_bitmask
from corral.grammar_engines.registry import BackendSet
from corral.grammars.spec import GrammarSpec

# xgrammar 0.2.8 relaxes oneOf to anyOf: "1" matches both branches (so it is invalid), "2" only one.
ONE_OF: dict[str, Any] = {"oneOf": [{"const": 1}, {"enum": [1, 2]}]}


def ids(tokenizer: TokenizerSpec, text: str) -> list[int]:
    return [int(t) for t in tokenizer.hf_tokenizer.encode(text, add_special_tokens=False)]


def fill(backend: SamplerBackend, matchers: list[Matcher], rows: list[int], vocab: int) -> torch.Tensor:
    bitmask = allocate_bitmask(max(rows) + 1, vocab)
    bitmask.zero_()
    backend.fill_bitmasks(matchers, bitmask, rows)
    return bitmask


def bit(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token >> 5]) >> (token & 31)) & 1)


def test_named_backend_is_the_engine_as_it_is(backends: BackendSet, tokenizer: TokenizerSpec) -> None:
    raw = backends.for_request("xgrammar", "xgrammar")
    matcher = raw.new_matcher(raw.compile(GrammarSpec.json_schema(ONE_OF)))
    assert not isinstance(matcher, GuardedMatcher)
    assert all(matcher.accept_token(t) for t in ids(tokenizer, "1"))
    assert matcher.can_terminate()  # the relaxation the guard exists for


def test_guard_refuses_to_end_where_one_of_is_violated(backends: BackendSet, tokenizer: TokenizerSpec) -> None:
    guarded = backends.for_request("xgrammar", "auto")
    compiled = guarded.compile(GrammarSpec.json_schema(ONE_OF))
    stop = tokenizer.stop_token_ids[0]
    invalid, valid = guarded.new_matcher(compiled), guarded.new_matcher(compiled)
    assert isinstance(invalid, GuardedMatcher)
    assert all(invalid.accept_token(t) for t in ids(tokenizer, "1"))
    assert all(valid.accept_token(t) for t in ids(tokenizer, "2"))
    # Batched fill (rows out of order), as the engine calls it.
    bitmask = fill(guarded, [valid, invalid], [1, 0], tokenizer.vocab_size)
    assert not bool(bitmask[0].any())  # "1": nothing may follow and it may not end: a dead end
    assert bit(bitmask, 1, stop)
    assert not invalid.can_terminate() and valid.can_terminate()
    assert invalid.validate_tokens([stop]) == 0 and valid.validate_tokens([stop]) == 1
    assert not invalid.accept_token(stop)
    assert invalid.error is not None and "full schema" in invalid.error
    # Backtracking out of the dead end: take "1" back, "2" can end.
    invalid.rollback(len(ids(tokenizer, "1")))
    assert invalid.error is None
    assert all(invalid.accept_token(t) for t in ids(tokenizer, "2"))
    assert invalid.can_terminate() and invalid.accept_token(stop)


def test_single_row_fill_matches_the_batched_fill(backends: BackendSet, tokenizer: TokenizerSpec) -> None:
    guarded = backends.for_request("xgrammar", "auto")
    matcher = guarded.new_matcher(guarded.compile(GrammarSpec.json_schema(ONE_OF)))
    for token in ids(tokenizer, "1"):
        matcher.accept_token(token)
    single = allocate_bitmask(1, tokenizer.vocab_size)
    matcher.fill_bitmask(single, 0)
    assert torch.equal(single[0], fill(guarded, [matcher], [0], tokenizer.vocab_size)[0])


def test_other_constraint_kinds_are_not_wrapped(backends: BackendSet, tokenizer: TokenizerSpec) -> None:
    guarded = backends.for_request("llguidance", "auto")
    for spec in (GrammarSpec.regex("[0-9]+"), GrammarSpec.json_object()):
        assert not isinstance(guarded.new_matcher(guarded.compile(spec)), GuardedMatcher)
    # A schema the engine enforces exactly ends as usual under the guard.
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    matcher = guarded.new_matcher(guarded.compile(GrammarSpec.json_schema(schema)))
    assert all(matcher.accept_token(t) for t in ids(tokenizer, '{"n": 3}'))
    assert matcher.can_terminate()
    assert bit(fill(guarded, [matcher], [0], tokenizer.vocab_size), 0, tokenizer.stop_token_ids[0])


def test_auto_serves_keywords_no_engine_enforces_through_the_decode_safe_profile(backends: BackendSet,
                                                                                tokenizer: TokenizerSpec) -> None:
    """Neither engine enforces `not`; auto compiles the decode-safe profile (llguidance lenient) and the
    guard enforces `not` where the answer would end."""
    schema = {"type": "array", "items": {"type": "integer"}, "maxItems": 2, "not": {"maxItems": 0}}
    cache = GrammarCache(backends)
    with pytest.raises(GrammarRejected):
        cache.compile(GrammarSpec.json_schema(schema), "llguidance")
    result = cache.compile(GrammarSpec.json_schema(schema), "auto")
    assert (result.backend, result.compiled.spec.decode_safe) == ("llguidance", True)
    guarded = backends.for_request(result.backend, "auto")
    empty, one = guarded.new_matcher(result.compiled), guarded.new_matcher(result.compiled)
    assert all(empty.accept_token(t) for t in ids(tokenizer, "[]"))  # the relaxed grammar takes it...
    assert not empty.can_terminate()  # ...the guard does not let it end
    assert all(one.accept_token(t) for t in ids(tokenizer, "[7]"))
    assert one.can_terminate()


def test_decode_safe_profile_is_its_own_cache_entry() -> None:
    full = GrammarSpec.json_schema({"type": "string"})
    relaxed = full.relaxed()
    assert relaxed.decode_safe and relaxed.source == full.source and relaxed.key != full.key
    with pytest.raises(ValueError, match="decode-safe"):
        GrammarSpec.regex("a+").relaxed()
