"""Drafts without a second model: tokens proposed by looking the answer's last few tokens up in the prompt and
in the answer so far (prompt lookup), cut where the grammar refuses them and extended by the tokens it forces.

An extraction copies names, numbers and dates from its prompt, a JSON answer repeats its keys, a tool call
quotes the user: the tokens after an earlier occurrence of the answer's last n tokens are a good guess for what
comes next. The engine feeds a row's draft with its real tokens in one forward and keeps the longest prefix the
model agrees with (corral/server/engine/speculation.py), so a draft never changes the answer, only the steps it takes.
"""

from __future__ import annotations

from collections.abc import Sequence as Tokens
from dataclasses import dataclass, field

import torch

from corral.grammar_engines.protocol import Matcher

NGRAM_MAX = 4  # the longest suffix looked up; longer matches are rarer and barely more precise
NGRAM_MIN = 2  # one token alone matches too often to be worth a position in the forward
DECAY = 0.8  # weight of a row's earlier drafts in its acceptance estimate: recent answers tell more
IDLE_DECAY = 0.97  # and per step without a draft: old evidence fades (half-life ~23 steps), a probe's stays a while


class NgramIndex:
    """Where each n-gram (NGRAM_MIN..NGRAM_MAX tokens) of a token list last occurred with a token after it.
    Grown as the answer grows; `tokens` may also shrink (a revision), which rebuilds it."""

    def __init__(self) -> None:
        self._next: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token that followed it
        self._tokens: list[int] = []

    def sync(self, tokens: Tokens[int]) -> None:
        """Index `tokens` (the prompt and the answer so far), adding only what is new since the last call."""
        known = len(self._tokens)
        if known > len(tokens) or self._tokens[-1:] != list(tokens[known - 1 : known]):
            self._next, self._tokens, known = {}, [], 0
        self._tokens.extend(tokens[known:])
        # An n-gram ending at i - 1 is followed by token i: index it once token i exists.
        for i in range(max(1, known), len(self._tokens)):
            for n in range(NGRAM_MIN, NGRAM_MAX + 1):
                if i - n >= 0:
                    self._next[tuple(self._tokens[i - n : i])] = i

    def continuation(self, tail: Tokens[int]) -> int | None:
        """Where the tokens after the longest indexed suffix of `tail` start in the indexed list, or None."""
        for n in range(min(NGRAM_MAX, len(tail)), NGRAM_MIN - 1, -1):
            found = self._next.get(tuple(tail[len(tail) - n :]))
            if found is not None:
                return found
        return None

    def token(self, index: int) -> int | None:
        return self._tokens[index] if index < len(self._tokens) else None


@dataclass
class Draft:
    """Tokens to feed after a row's real ones: `forced[i]` marks the grammar's own (no logit decides them)."""

    tokens: list[int] = field(default_factory=list)
    forced: list[bool] = field(default_factory=list)
    start: int = 0  # the answer's length when it was drafted: its first token is the guess for output[start]
    cached: int = 0  # the row's KV positions before the draft's (its real tokens' included)
    # With a grammar: its bitmask at each `outputs` place, and the allowed ids of the places that allow few
    # (their logits are computed for those ids alone, as a sparse row's are).
    masks: torch.Tensor | None = None
    sparse: dict[int, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.tokens)

    def outputs(self) -> list[int]:
        """The draft places whose logits verification reads: before each guess, and after the last token (the
        model's own pick there is free). A place before a forced token needs none: the grammar decides it."""
        return [j for j in range(len(self.tokens)) if j == len(self.tokens) - 1 or not self.forced[j + 1]]

    @property
    def proposed(self) -> int:
        """The draft's guesses (the tokens the model must agree with)."""
        return self.forced.count(False)


def propose(
    index: NgramIndex,
    context: list[int],
    limit: int,
    matcher: Matcher | None,
    stop_ids: frozenset[int],
    forced_room: int,
) -> Draft:
    """Up to `limit` draft tokens after `context` (the prompt, the answer and the row's pending tokens). With a
    grammar, each guess must be accepted by `matcher`, and the tokens the grammar then forces follow it (within
    `forced_room`, as jump-forward would append them); the matcher is put back as it was before returning."""
    draft = Draft()
    tail = context[-NGRAM_MAX:]
    source = index.continuation(tail)
    accepted = 0
    try:
        while source is not None and len(draft) < limit:
            guess = index.token(source)
            if guess is None or guess in stop_ids:
                break
            if matcher is not None:
                if not matcher.accept_token(guess):
                    break
                accepted += 1
            draft.tokens.append(guess)
            draft.forced.append(False)
            tail = [*tail, guess][-NGRAM_MAX:]
            source += 1
            if matcher is not None:
                forced = forced_run(matcher, stop_ids, forced_room - len(draft))
                accepted += len(forced)
                draft.tokens += forced
                draft.forced += [True] * len(forced)
                if forced:
                    tail = [*tail, *forced][-NGRAM_MAX:]
                    # The copy goes on past the forced tokens where its source has them too, else it is looked up anew.
                    following = [index.token(source + i) for i in range(len(forced))]
                    source = source + len(forced) if following == forced else index.continuation(tail)
                if matcher.is_terminated():
                    break
    finally:
        if matcher is not None and accepted:
            matcher.rollback(accepted)
    del draft.tokens[limit:], draft.forced[limit:]
    return draft


def forced_run(matcher: Matcher, stop_ids: frozenset[int], room: int) -> list[int]:
    """Jump-forward's rule: the tokens the grammar dictates next (at most `room`, never a stop token), accepted
    into `matcher`. A step's jump-forward (GrammarTokens.forced_after) and a draft's forced tokens both use it, so
    a draft carries exactly the tokens the step will append."""
    forced: list[int] = []
    if matcher.is_terminated() or room <= 0:
        return forced
    for token in matcher.forced_tokens()[:room]:
        if token in stop_ids or not matcher.accept_token(token):
            break
        forced.append(token)
    return forced


@dataclass
class DraftCounts:
    """A sequence's drafting: guesses fed and accepted, drafts fed, and its decayed acceptance tallies."""

    proposed: int = 0
    accepted: int = 0
    drafts: int = 0
    kept: float = 0.0
    refused: float = 0.0
    dense_share: float = 1.0  # of its draft places, the share whose logits need the whole vocabulary (decayed)
    idle_steps: int = 0  # steps since its last draft

    @property
    def rate(self) -> float:
        """The chance a guess is accepted given the one before it was (Laplace's rule over decayed tallies)."""
        return (self.kept + 1.0) / (self.kept + self.refused + 2.0)

    def record(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        self.drafts += 1
        self.idle_steps = 0
        self.kept = self.kept * DECAY + accepted
        self.refused = self.refused * DECAY + (1.0 if accepted < proposed else 0.0)

    def saw_places(self, places: int, sparse: int) -> None:
        """A draft's logit places under the grammar, `sparse` of them allowing few tokens."""
        if places:
            self.dense_share = self.dense_share * DECAY + (1 - DECAY) * (places - sparse) / places

    def idle(self) -> int:
        """A step it could have drafted in but did not (too unlikely to pay): the evidence ages, so a row that
        drafted badly once tries again later (its answer may have reached text it copies). Returns the steps
        since its last draft."""
        self.kept *= IDLE_DECAY
        self.refused *= IDLE_DECAY
        self.idle_steps += 1
        return self.idle_steps
