"""Per-token log probabilities as the engine records them, and which of them a piece of text covers.

An entry is the logprob of the token actually appended, under the distribution it was drawn from (see
corral/server/engine/sampling.py), plus the most likely alternatives there. A token appended by jump-forward was the
only one the grammar allowed: probability 1, logprob 0.0, and itself as the only alternative.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

Decode = Callable[[list[int]], str]


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first; never a probability-0 token

    @staticmethod
    def forced(token: int, top_logprobs: int) -> TokenLogprob:
        return TokenLogprob(token, 0.0, ((token, 0.0),) if top_logprobs > 0 else ())


def tokens_within(decode: Decode, ids: Sequence[int], start: int, limit: int, chars: int) -> int:
    """The largest k in [start, limit] whose first k tokens decode to at most `chars` characters: the
    tokens whose text has been shown in full once `chars` characters are out (a token that ends in half a
    character counts as longer, so it waits for the token that completes it)."""
    k = start
    while k < limit and len(decode(list(ids[: k + 1]))) <= chars:
        k += 1
    return k


def tokens_reaching(decode: Decode, ids: Sequence[int], start: int, chars: int) -> int:
    """The fewest tokens (at least `start`) whose text reaches `chars` characters: the tokens an answer cut
    to `chars` characters (at a stop string) came from."""
    if chars <= 0 or len(decode(list(ids[:start]))) >= chars:
        return start
    return min(len(ids), tokens_within(decode, ids, start, len(ids), chars - 1) + 1)
