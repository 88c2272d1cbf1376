"""llguidance's tokenizer over the model's vocabulary, without a second copy of the Hugging Face tokenizer.

Given a tokenizer's JSON, llguidance builds its own Rust copy of the Hugging Face tokenizer and keeps it, to
tokenize the few texts it needs tokens for (forced runs, a matcher's start). On Gemma 3's 262,144-token vocabulary
that copy is ~120 MB, held again by the server and by the compile zygote beside the tokenizer the server already
has. So the JSON is read once, with no slices, only for each token's bytes and which tokens are special; llguidance
then gets those through its `TokenizerWrapper` protocol (`VocabularyTokenizer`), and tokenizes through the
server's own Rust tokenizer: 109 MB instead of 225 (slices included) on Gemma 3, and 44 instead of 133 in a compile
worker, which tokenizes nothing that matters and drops both the slices and the tokenizer (`compile_only`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import llguidance
import llguidance.hf

from corral.grammar_engines.protocol import TokenizerSpec


class VocabularyTokenizer(llguidance.TokenizerWrapper):
    """llguidance's `TokenizerWrapper`: the vocabulary's bytes, its special tokens, and `__call__` tokenizing a
    text (without special tokens added, as llguidance's own Hugging Face reader does). Its base class wraps another
    library's tokenizer object; this one holds the values themselves."""

    def __init__(  # the base's __init__ reads a tokenizer object this class does not have: not called
        self, tokens: list[bytes], special_token_ids: list[int], eos: int, encode: Callable[[str], list[int]]
    ) -> None:
        self.tokens, self.special_token_ids = tokens, special_token_ids
        self.eos_token_id, self.bos_token_id = eos, None
        self.is_tokenizer_wrapper = True
        self.encode = encode

    def __call__(self, text: str | bytes) -> list[int]:
        return self.encode(text.decode() if isinstance(text, bytes) else text)


def ll_tokenizer(tokenizer: TokenizerSpec) -> tuple[llguidance.LLTokenizer, VocabularyTokenizer | None]:
    """llguidance's tokenizer over `tokenizer`'s vocabulary, and the wrapper it reads (None where the tokenizer
    has no Rust tokenizer: llguidance's own helper reads it then)."""
    backend = getattr(tokenizer.hf_tokenizer, "backend_tokenizer", None)
    eos = list(tokenizer.stop_token_ids)
    if backend is None:
        return llguidance.hf.from_tokenizer(tokenizer.hf_tokenizer, n_vocab=tokenizer.vocab_size, eos_token=eos), None
    if backend.padding is not None or backend.truncation is not None:
        backend = copy.deepcopy(backend)  # the server's own keeps its settings; texts here are never padded
        backend.no_padding()
        backend.no_truncation()
    reader = llguidance.LLTokenizer(backend.to_str(), n_vocab=tokenizer.vocab_size, eos_token=eos, slices=[])
    size = reader.vocab_size
    tokens = [reader.decode_bytes([i]) for i in range(size)]
    special = [i for i in range(size) if reader.is_special_token(i)]
    del reader  # its Rust copy of the tokenizer is what this module avoids keeping

    def encode(text: str) -> list[int]:
        ids: list[int] = backend.encode(text, add_special_tokens=False).ids
        return ids

    vocabulary = VocabularyTokenizer(tokens, special, eos[0], encode)
    return llguidance.LLTokenizer(vocabulary, n_vocab=size, eos_token=eos), vocabulary


def special_ids_by_text(tokenizer: llguidance.LLTokenizer, vocabulary: VocabularyTokenizer | None) -> dict[str, int]:
    """Each special token's id by its text (from the wrapper's lists where there is one)."""
    if vocabulary is not None:
        return {vocabulary.tokens[i].decode(errors="replace"): i for i in vocabulary.special_token_ids}
    ids = [i for i in range(tokenizer.vocab_size) if tokenizer.is_special_token(i)]
    return {tokenizer.decode_bytes([i]).decode(errors="replace"): i for i in ids}


def compile_only(tokenizer: llguidance.LLTokenizer, vocabulary: VocabularyTokenizer | None) -> llguidance.LLTokenizer:
    """The tokenizer a compile worker keeps: no slices (they speed up masks, which a worker never fills) and, for
    a wrapper, llguidance's greedy tokenizing instead of the Rust tokenizer, which can then go (a worker's
    matchers are checks; the server builds its own)."""
    lean = tokenizer.with_slices([])
    if vocabulary is not None:
        vocabulary.encode = lean.greedy_tokenize
    return lean
