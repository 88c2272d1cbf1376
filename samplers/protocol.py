"""The two seams every grammar engine plugs into: an engine-level backend and a per-request matcher."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from grammars.spec import GrammarSpec


class CompileError(ValueError):
    """A spec the backend cannot turn into a grammar. The message names the offending place."""

    def __init__(self, message: str, *, backend: str, unsupported: bool = False) -> None:
        super().__init__(message)
        self.backend = backend
        # True when the spec is well-formed but uses something this backend cannot enforce,
        # so `auto` should try the next backend rather than blame the caller.
        self.unsupported = unsupported


@dataclass(frozen=True)
class TokenizerSpec:
    """What a backend needs to know about the model's tokenizer."""

    hf_tokenizer: Any  # a transformers PreTrainedTokenizerFast
    vocab_size: int  # width of the model's logits (may exceed the tokenizer's own vocabulary)
    stop_token_ids: tuple[int, ...]


@runtime_checkable
class Matcher(Protocol):
    """Per-request grammar state. Grammar errors are values (`error`), never exceptions into the loop."""

    @property
    def error(self) -> str | None: ...

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token bits for the next position into `bitmask[row]` (CPU int32)."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (and state unchanged) when the grammar rejects it."""

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of `token_ids` the grammar would accept, without advancing."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar allows as the only continuation (jump-forward), canonically tokenised."""

    def is_terminated(self) -> bool:
        """True once the grammar has consumed a stop token or can accept nothing further."""

    def can_terminate(self) -> bool:
        """True when the text so far is a complete match (a stop token would be accepted)."""


class CompiledGrammar(Protocol):
    """Opaque, immutable and shareable between requests; produced by `SamplerBackend.compile`."""

    @property
    def spec(self) -> GrammarSpec: ...

    @property
    def backend_name(self) -> str: ...


class SamplerBackend(Protocol):
    """Engine-level and thread-safe: one instance serves every request of a model."""

    name: str

    def supports(self, spec: GrammarSpec) -> str | None:
        """None when this backend can enforce `spec`; otherwise the reason it cannot."""

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile `spec` (slow; called off the event loop). Raises CompileError."""

    def new_matcher(self, compiled: CompiledGrammar) -> Matcher: ...

    def fill_bitmasks(self, matchers: Sequence[Matcher], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        """Fill many rows at once; implementations release the GIL and use their own threads."""


def allocate_bitmask(batch_size: int, vocab_size: int) -> torch.Tensor:
    """All-allowed int32 bitmask, the layout both engines share (bit i of word j = token 32*j+i)."""
    return torch.full((batch_size, (vocab_size + 31) // 32), -1, dtype=torch.int32)
