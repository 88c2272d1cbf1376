"""`logprobs` in OpenAI's shapes, from the engine's per-token entries (corral/server/engine/logprobs.py).

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`.
Completions: `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, where each `top_logprobs` entry maps
token text to logprob for the N most likely tokens plus the one sampled (OpenAI: up to N + 1 entries).
`token` is the token's own decoded text (U+FFFD where it holds part of a character); `bytes` are its exact bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from corral.server.engine.logprobs import TokenLogprob
from corral.server.errors import bad_request
from corral.server.openai.protocol import ChatCompletionRequest, CompletionRequest, _Request


def requested_logprobs(req: _Request) -> tuple[bool, int]:
    """(record logprobs, alternatives per position) from chat's `logprobs` + `top_logprobs` or completions'
    integer `logprobs`."""
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
        return req.logprobs, req.top_logprobs or 0
    if isinstance(req, CompletionRequest) and req.logprobs is not None:
        return True, req.logprobs
    return False, 0


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, char → byte: printable bytes stand for themselves, the rest are
    shifted past U+0100 in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    shifted = iter(range(256, 512))
    return {chr(b if b in printable else next(shifted)): b for b in range(256)}


_BYTE_LEVEL = _byte_level_alphabet()


class TokenText:
    """A token's text and exact bytes, for any Hugging Face tokenizer (byte-level BPE, SentencePiece with byte
    fallback, added/special tokens); cached per token."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = "ByteLevel" in repr(decoder)
        self._added = {int(i) for i in getattr(tokenizer, "added_tokens_decoder", {})}
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        cached = self._cache.get(token)
        if cached is None:
            cached = self._cache[token] = (str(self._tokenizer.decode([token])), list(self._bytes(token)))
        return cached

    def _bytes(self, token: int) -> bytes:
        piece = str(self._tokenizer.convert_ids_to_tokens(token))
        if token in self._added:
            return piece.encode()
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece byte fallback
            return bytes([int(piece[3:5], 16)])
        if self._byte_level and all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
        return piece.replace("▁", " ").encode()

    def offsets(self, before: Sequence[int], tokens: Sequence[int]) -> list[int]:
        """Where each of `tokens` starts in the text of `before + tokens` (a token that completes a character
        begun by the one before starts where that character does)."""
        ids = list(before)
        starts = []
        for token in tokens:
            text = str(self._tokenizer.decode(ids, skip_special_tokens=True)) if ids else ""
            starts.append(len(text.rstrip("\ufffd")))
            ids.append(token)
        return starts


_TEXTS: dict[int, tuple[Any, TokenText]] = {}


def token_text(tokenizer: Any) -> TokenText:
    """The TokenText of `tokenizer`, built once per tokenizer (its cache outlives requests)."""
    entry = _TEXTS.get(id(tokenizer))
    if entry is None or entry[0] is not tokenizer:
        entry = _TEXTS[id(tokenizer)] = (tokenizer, TokenText(tokenizer))
    return entry[1]


def chat_logprobs(entries: Sequence[TokenLogprob], text: TokenText) -> dict[str, Any]:
    def item(token: int, logprob: float) -> dict[str, Any]:
        string, raw = text(token)
        return {"token": string, "logprob": logprob, "bytes": raw}

    return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(*t) for t in e.top]} for e in entries]}


def completion_logprobs(
    entries: Sequence[TokenLogprob], text: TokenText, *, top_n: int, before: Sequence[int] = ()
) -> dict[str, Any]:
    """`before`: the token ids of this choice sent earlier (streaming), so `text_offset` counts from the start
    of the choice's text."""
    return {
        "tokens": [text(e.token)[0] for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [
            {**{text(t)[0]: lp for t, lp in e.top[:top_n]}, text(e.token)[0]: e.logprob} for e in entries
        ],
        "text_offset": text.offsets(before, [e.token for e in entries]),
    }
