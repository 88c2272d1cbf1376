"""The engine's output stage: token ids to text, stop strings, and the deltas and logprobs a request is sent.

Text is sent only once no revision can take it back and it cannot be the start of a stop string; logprob
entries follow the text their tokens complete.
"""

from __future__ import annotations

from typing import Any

from corral.grammar_engines.answer_text import answer_text
from corral.server.engine.logprobs import TokenLogprob, tokens_reaching, tokens_within
from corral.server.engine.sequence import SeqOutput, Sequence


class OutputStage:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        # Special tokens are skipped, but for those that spell a tool-call marker: the call parser reads them.
        self._answer = answer_text(tokenizer)
        self._whitespace: dict[int, bool] = {}
        self._texts: dict[int, str] = {}

    def decode(self, ids: list[int]) -> str:
        return self._answer.decode(ids)

    def encode(self, text: str) -> list[int]:
        """The text's tokens, no special tokens added."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def token_text(self, token: int) -> str:
        cached = self._texts.get(token)
        if cached is None:
            cached = self._texts[token] = str(self.tokenizer.decode([token]))
        return cached

    def is_whitespace(self, token: int) -> bool:
        cached = self._whitespace.get(token)
        if cached is None:
            text = self.token_text(token)
            cached = self._whitespace[token] = bool(text) and not text.strip()
        return cached

    def emit(self, seq: Sequence) -> bool:
        """Decode, cut at a stop string if one appeared, and hand new, no-longer-retractable text to the
        sink. Returns True when a stop string ended the text (the caller finishes the sequence)."""
        text = self.decode(seq.output_ids)
        stopped = False
        for stop in seq.params.stop:
            found = text.find(stop, max(0, seq.emitted - len(stop)))
            if found != -1:
                text, stopped = text[:found], True
        seq.text = text
        if stopped:
            seq.text_cut = True
            return True
        stable = seq.revision.stable_tokens(len(seq.output_ids))
        if seq.closer is not None and seq.closer.fallback is not None:
            # Near the budget an answer may close from an earlier point (corral/structured/answer_closing.py): the
            # text after it is not final until the answer ends or the fallback moves on.
            stable = min(stable, seq.closer.fallback[0])
        if stable < len(seq.output_ids):
            safe = len(self.decode(seq.output_ids[:stable]).rstrip("\ufffd"))
        else:
            safe = len(text.rstrip("\ufffd"))
        safe = _before_stop_prefix(text, min(safe, len(text)), seq.params.stop)
        if safe > seq.emitted:
            delta, seq.emitted = text[seq.emitted : safe], safe
            seq.sink(SeqOutput(seq.request_id, delta, False, None, seq, self.logprobs_out(seq, final=False)))
        return False

    def final(self, seq: Sequence, reason: str) -> SeqOutput:
        """The sequence's last output: the rest of its text (none after an abort) and logprobs."""
        if reason != "abort" and not seq.text_cut:
            seq.text = self.decode(seq.output_ids)
        delta = seq.text[seq.emitted :] if reason != "abort" else ""
        seq.emitted = len(seq.text)
        return SeqOutput(seq.request_id, delta, True, reason, seq, self.logprobs_out(seq, final=True))

    def logprobs_out(self, seq: Sequence, *, final: bool) -> list[TokenLogprob]:
        """The entries not yet sent whose tokens' text is now out in full, and that no revision can take back.
        At the end: all the rest, less those past a stop-string cut (dropped from `seq.logprobs` too)."""
        if not seq.params.logprobs:
            return []
        ids, sent = seq.output_ids, seq.logprobs_sent
        if not final:
            end = tokens_within(self.decode, ids, sent, seq.revision.stable_tokens(len(ids)), seq.emitted)
        elif seq.text_cut:
            end = tokens_reaching(self.decode, ids, sent, len(seq.text))
            del seq.logprobs[end:]
        else:
            end = len(ids)
        seq.logprobs_sent = max(sent, end)
        return seq.logprobs[sent:end]


def _before_stop_prefix(text: str, safe: int, stops: tuple[str, ...]) -> int:
    """Hold back a possible stop-string prefix at the end of what would be sent."""
    for stop in stops:
        for k in range(min(len(stop) - 1, safe), 0, -1):
            if text[safe - k : safe] == stop[:k]:
                safe -= k
                break
    return safe
