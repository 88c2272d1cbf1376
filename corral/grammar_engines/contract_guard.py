"""Contract guard: a JSON Schema answer may only end when the whole schema holds.

Both engines compile a *decode-time subset* of JSON Schema: xgrammar 0.2.8 relaxes `oneOf` to `anyOf` and
lets some `enum`, `maximum` and `format` violations through (docs/benchmarks.md, strictness per keyword).
The guard wraps a backend so that, wherever its mask allows a stop token, the text so far is checked
against the full schema (jsonschema + format checker, `corral.grammars.validation`); if it fails, the stop
tokens are cleared from the mask and refused by `accept_token`. A document that can only end invalid
leaves an empty mask, which the engine treats as a dead end and backtracks out of.

The check runs only where the grammar could end (for JSON, after the last closing bracket, or after
each digit of a top-level number), once per position; elsewhere the cost is reading a few mask words.
`auto` serves through the guard; an explicitly named backend is the engine as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from corral.grammar_engines.answer_text import answer_text
from corral.grammar_engines.protocol import CompiledGrammar, Matcher, SamplerBackend, TokenizerSpec
from corral.grammars.contract import validate_output
from corral.grammars.spec import GrammarKind, GrammarSpec

# Tool calls embed JSON Schemas the same engines relax; an answer may only end where every call validates.
GUARDED_KINDS = (GrammarKind.JSON_SCHEMA, GrammarKind.TOOL_CALLS)


class GuardedMatcher:
    """A backend's matcher plus the full-contract check wherever it could end."""

    def __init__(self, inner: Matcher, spec: GrammarSpec, tokenizer: TokenizerSpec) -> None:
        self.inner = inner
        self._spec = spec
        self._text = answer_text(tokenizer.hf_tokenizer)  # the text the answer's check will read
        self._stops = frozenset(tokenizer.stop_token_ids)
        self._tokens: list[int] = []
        self._checked: tuple[int, bool] | None = None  # (token count, whole-contract verdict)
        self._error: str | None = None
        self._views = _Uint32View()

    @property
    def error(self) -> str | None:
        return self._error or self.inner.error

    def contract_holds(self, extra: Sequence[int] = ()) -> bool:
        """Does the text so far (plus `extra` tokens) satisfy the full schema? Cached per length."""
        tokens = [*self._tokens, *extra]
        if self._checked is not None and self._checked[0] == len(tokens) and not extra:
            return self._checked[1]
        text = self._text.decode(tokens)
        verdict = validate_output(self._spec, text).valid
        if not extra:
            self._checked = (len(tokens), verdict)
        return verdict

    def guard_row(self, bits: np.ndarray[Any, Any], row: int) -> None:
        """Clear the stop tokens from an already filled row (uint32 view) unless the contract holds."""
        allowed = [s for s in self._stops if (int(bits[row, s >> 5]) >> (s & 31)) & 1]
        if allowed and not self.contract_holds():
            for stop in allowed:
                bits[row, stop >> 5] &= np.uint32(~(1 << (stop & 31)) & 0xFFFFFFFF)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.inner.fill_bitmask(bitmask, row)
        self.guard_row(self._views.of(bitmask), row)

    def accept_token(self, token_id: int) -> bool:
        if token_id in self._stops and not self.contract_holds():
            self._error = "the answer does not satisfy the full schema here, so it cannot end"
            return False
        ok = self.inner.accept_token(token_id)
        if ok:
            self._tokens.append(token_id)
        return ok

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        count = self.inner.validate_tokens(token_ids)
        for index, token in enumerate(token_ids[:count]):
            if token in self._stops and not self.contract_holds(token_ids[:index]):
                return index
        return count

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.inner.rollback(num_tokens)
            del self._tokens[-num_tokens:]
            self._checked = None  # the same length may now hold other tokens
            self._error = None

    def forced_tokens(self) -> list[int]:
        forced = self.inner.forced_tokens()
        for index, token in enumerate(forced):
            if token in self._stops:
                return forced[:index]  # ending is the guard's call, not a forced move
        return forced

    def is_terminated(self) -> bool:
        # An engine may stop by itself after a closing bracket (nothing else fits); that end still
        # needs the contract, else the mask (stop cleared, nothing else allowed) sends it back.
        return self.inner.is_terminated() and self.contract_holds()

    def can_terminate(self) -> bool:
        return self.inner.can_terminate() and self.contract_holds()


class ContractGuard:
    """Wraps a SamplerBackend; JSON Schema and tool-call matchers come back guarded, other kinds unchanged."""

    def __init__(self, inner: SamplerBackend, tokenizer: TokenizerSpec) -> None:
        self.inner = inner
        self.name = inner.name  # metrics and responses name the engine that did the work
        self._tokenizer = tokenizer
        self._views = _Uint32View()

    def supports(self, spec: GrammarSpec) -> str | None:
        return self.inner.supports(spec)

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        return self.inner.compile(spec)

    def new_matcher(self, compiled: CompiledGrammar) -> Matcher:
        matcher = self.inner.new_matcher(compiled)
        if compiled.spec.kind not in GUARDED_KINDS:
            return matcher  # regex, choice, grammar and json_object: the grammar is the whole contract
        return GuardedMatcher(matcher, compiled.spec, self._tokenizer)

    def fill_bitmasks(self, matchers: Sequence[Matcher], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        inner = [m.inner if isinstance(m, GuardedMatcher) else m for m in matchers]
        self.inner.fill_bitmasks(inner, bitmask, rows)
        for matcher, row in zip(matchers, rows, strict=True):
            if isinstance(matcher, GuardedMatcher):
                matcher.guard_row(self._views.of(bitmask), row)


class _Uint32View:
    """The bitmask as unsigned words, made once per tensor: a fresh numpy view each fill costs more than the
    check itself (measured: docs/measured-choices.md#contract-guard). One attribute holds the pair, so threads
    filling different bitmasks never see one tensor's view under another's."""

    def __init__(self) -> None:
        self._pair: tuple[torch.Tensor, np.ndarray[Any, Any]] | None = None

    def of(self, bitmask: torch.Tensor) -> np.ndarray[Any, Any]:
        pair = self._pair
        if pair is None or pair[0] is not bitmask:
            pair = (bitmask, bitmask.numpy().view(np.uint32))
            self._pair = pair
        return pair[1]
