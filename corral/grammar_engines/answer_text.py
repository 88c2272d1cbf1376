"""How an answer's token ids read as text: special tokens skipped, as transformers' `skip_special_tokens` skips
them, except those that spell a tool-call marker (`corral.grammars.tools.MARKERS`: `<tool_call>`, `[TOOL_CALLS]`),
which the call parser must see. A vocabulary where no marker is a skipped special token (Qwen 2.5 writes
`<tool_call>` as an added but not special token; Llama 3) decodes exactly as before."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from corral.grammars.tools import MARKERS


class AnswerText:
    """The decoder of one tokenizer; build it once (`answer_text`), it reads the added tokens once."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        added: dict[int, Any] = dict(getattr(tokenizer, "added_tokens_decoder", None) or {})
        special = {i: str(t.content) for i, t in added.items() if getattr(t, "special", False)}
        self.kept = frozenset(i for i, content in special.items() if content in MARKERS)
        # With kept markers: the other special tokens are dropped here and the rest decoded with none skipped,
        # which is what the Rust decoder does with `skip_special_tokens` (it filters its special ids first).
        self._skipped = frozenset(special) - self.kept if self.kept else None

    def decode(self, ids: Sequence[int]) -> str:
        if self._skipped is None:
            return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))
        kept = [i for i in ids if i not in self._skipped]
        return str(self.tokenizer.decode(kept, skip_special_tokens=False))


_DECODERS: dict[int, tuple[Any, AnswerText]] = {}


def answer_text(tokenizer: Any) -> AnswerText:
    """The AnswerText of `tokenizer`, built once per tokenizer object."""
    entry = _DECODERS.get(id(tokenizer))
    if entry is None or entry[0] is not tokenizer:
        entry = _DECODERS[id(tokenizer)] = (tokenizer, AnswerText(tokenizer))
    return entry[1]
