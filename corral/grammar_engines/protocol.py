"""The seam every grammar engine plugs into: an engine-level backend, a per-request matcher, and the
descriptor a backend is registered with (its factory, its traits, its sandbox codec)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from corral.grammars.features import BackendTraits
from corral.grammars.spec import GrammarSpec


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


BackendFactory = Callable[[TokenizerSpec], SamplerBackend]


class Codec(Protocol):
    """How a backend's compiled grammar crosses the compile sandbox's process boundary
    (corral/grammar_engines/sandbox.py).
    One instance per process side, made by `BackendDescriptor.codec()`; it may keep per-process state."""

    def export(self, compiled: CompiledGrammar) -> Any:
        """In the worker: a picklable payload for `restore`, or None when rebuilding is cheaper."""

    def restore(self, impl: SamplerBackend, spec: GrammarSpec, payload: Any) -> CompiledGrammar:
        """In the parent: the compiled grammar, equivalent to `impl.compile(spec)`. Without a payload
        it compiles again in-process: the worker just did the same work within the deadline, so this
        is bounded (a success can thus take up to ~2x the deadline; a refusal never does)."""


@dataclass(frozen=True)
class Lazy:
    """A `module:attribute` reference, imported on first use (xgrammar pulls in triton, for instance);
    calling it calls the attribute. Picklable, so a descriptor made of these crosses to a compile worker."""

    target: str

    def load(self) -> Any:
        module_name, _, attribute = self.target.partition(":")
        return getattr(importlib.import_module(module_name), attribute)

    def __call__(self, *args: Any) -> Any:
        return self.load()(*args)


@dataclass(frozen=True)
class BackendDescriptor:
    """Everything corral knows about one backend, registered under its name (corral/grammar_engines/registry.py): how to
    build it, what `auto` routing and the keyword report may assume of it (`traits`, plain data the grammars
    layer reads), and how its compiled grammars cross a process boundary (`codec`; None: the backend
    compiles in the caller's thread, never in a killable worker). A compile worker receives the descriptor
    pickled, so a backend with a codec must be importable by the worker (a module-level class or function)."""

    factory: BackendFactory
    traits: BackendTraits = field(default_factory=BackendTraits)
    codec: Callable[[], Codec] | None = None

    def makes(self, impl: SamplerBackend) -> bool:
        """False when `impl` is not what `factory` builds (a test double standing in under the same name)."""
        made = self.factory.load() if isinstance(self.factory, Lazy) else self.factory
        return not isinstance(made, type) or type(impl) is made


def allocate_bitmask(batch_size: int, vocab_size: int) -> torch.Tensor:
    """All-allowed int32 bitmask, the layout both engines share (bit i of word j = token 32*j+i)."""
    return torch.full((batch_size, (vocab_size + 31) // 32), -1, dtype=torch.int32)
