"""Drafts without a second model: tokens proposed by looking the answer's last few tokens up in the prompt and
in the answer so far (prompt lookup), cut where the grammar refuses them and extended by the tokens it forces.

An extraction copies names, numbers and dates from its prompt, a JSON answer repeats its keys, a tool call
quotes the user: the tokens after an earlier occurrence of the answer's last n tokens are a good guess for what
comes next. The engine feeds a row's draft with its real tokens in one forward and keeps the longest prefix the
model agrees with (corral/server/engine/speculation.py), so a draft never changes the answer, only the steps it takes.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Tokens
from dataclasses import dataclass, field

import torch

from corral.grammar_engines.protocol import Matcher

NGRAM_MAX = 4  # the longest suffix looked up; longer matches are rarer and barely more precise
NGRAM_MIN = 2  # one token alone matches too often to be worth a position in the forward...
# ...but for a grammar's punctuation (`":` then ` "`, `",` then a line break), whose answer repeats its own shape.
DECAY = 0.8  # weight of a row's earlier drafts in its acceptance estimate: recent answers tell more
IDLE_DECAY = 0.97  # and per step without a draft or a shadow's outcome: old evidence fades (half-life ~23 steps)
# A row that does not feed a draft still looks one up (a *shadow*) and, as its answer follows or leaves it, counts
# the guesses it would have kept: its acceptance is measured at no cost, so a row whose text starts to copy drafts
# as soon as its shadows keep. Probes fed to measure it cost Qwen2.5's text that copies nothing 0.91-0.95x its
# speed without drafts at concurrency 1 (a 4-token step costs 1.6-2.6 steps of 1), and ran only at concurrency 1.
# A new row of a kind whose recent drafts across requests (free text, or under a grammar) kept little starts from
# that history, weighed as SEED_DRAFTS drafts' worth of evidence: no drafts at first. Each row starting at the
# even prior instead cost Qwen2.5's free text 0.96x llama-server's TPOT at c1 against 1.01x with drafts off
# (`corral bench paired`).
SEED_DRAFTS = 4.0
HISTORY_DECAY = 0.95  # per draft of the kind: the last few dozen drafts make the history
# A text lookup (PromptText) matches the answer's last characters since its last quote, at least TEXT_KEY_MIN of
# them (fewer match anywhere) and at most TEXT_KEY_MAX, and tokenizes TEXT_AHEAD characters of the prompt after
# the match as its guesses.
TEXT_KEY_MIN = 3
TEXT_KEY_MAX = 24
TEXT_TAIL_TOKENS = 8
TEXT_AHEAD = 96


class NgramIndex:
    """Where each n-gram (1..NGRAM_MAX tokens) of a token list last occurred with a token after it.
    Grown as the answer grows; `tokens` may also shrink (a revision), which rebuilds it."""

    def __init__(self) -> None:
        self._next: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token that followed it
        self._tokens: list[int] = []
        self.prompt_text: str | None = None  # the row's prompt as text, for PromptText's lookups

    def sync(self, tokens: Tokens[int]) -> None:
        """Index `tokens` (the prompt and the answer so far), adding only what is new since the last call."""
        known = len(self._tokens)
        if known > len(tokens) or self._tokens[-1:] != list(tokens[known - 1 : known]):
            self._next, self._tokens, known = {}, [], 0
        self._tokens.extend(tokens[known:])
        # An n-gram ending at i - 1 is followed by token i: index it once token i exists.
        for i in range(max(1, known), len(self._tokens)):
            for n in range(1, NGRAM_MAX + 1):
                if i - n >= 0:
                    self._next[tuple(self._tokens[i - n : i])] = i

    def continuation(
        self, tail: Tokens[int], vague: Callable[[tuple[int, ...], int], bool] | None = None, shortest: int = NGRAM_MIN
    ) -> int | None:
        """Where the tokens after the longest indexed suffix of `tail` (at least `shortest` tokens) start in the
        indexed list, or None. Where `vague(suffix, next_token)` says a suffix does not predict the token that
        followed it, the lookup ends."""
        for n in range(min(NGRAM_MAX, len(tail)), shortest - 1, -1):
            suffix = tuple(tail[len(tail) - n :])
            found = self._next.get(suffix)
            if found is not None:
                return None if vague is not None and vague(suffix, self._tokens[found]) else found
        return None

    def token(self, index: int) -> int | None:
        return self._tokens[index] if index < len(self._tokens) else None


class _Copied:
    """Guesses a text lookup tokenized, read as NgramIndex's are (no lookup anew after forced tokens)."""

    def __init__(self, tokens: list[int]) -> None:
        self._tokens = tokens

    def token(self, index: int) -> int | None:
        return self._tokens[index] if index < len(self._tokens) else None

    def continuation(
        self, tail: Tokens[int], vague: Callable[[tuple[int, ...], int], bool] | None = None, shortest: int = NGRAM_MIN
    ) -> int | None:
        return None


class PromptText:
    """Copies that start inside one of the prompt's tokens. A JSON string value starts after its quote, so its
    first tokens are not the prompt's (` Casa` there; `"`, `C`, `asa` in the answer) and no n-gram of tokens
    matches until the copy is several tokens old. Matching the answer's text since its last quote in the prompt's
    text, and tokenizing what follows there, guesses the rest of the copy one or two tokens in. Also tells which
    tokens carry a letter or a digit (`informative`), for the token lookups."""

    def __init__(
        self, token_text: Callable[[int], str], encode: Callable[[str], list[int]], decode: Callable[[list[int]], str]
    ) -> None:
        self._token_text, self._encode, self.decode = token_text, encode, decode
        self._informative: dict[int, bool] = {}

    def informative(self, token: int) -> bool:
        known = self._informative.get(token)
        if known is None:
            known = self._informative[token] = any(c.isalnum() for c in self._token_text(token))
        return known

    def guesses(self, prompt_text: str, answer: Tokens[int], limit: int) -> list[int]:
        """Up to `limit` tokens of the prompt's text after the answer's last characters (since its last quote,
        at most TEXT_KEY_MAX), where they occur last in it; none where they are too short or absent."""
        text = "".join(self._token_text(t) for t in answer[-TEXT_TAIL_TOKENS:])
        key = text[text.rfind('"') + 1 :][-TEXT_KEY_MAX:]
        if len(key.strip()) < TEXT_KEY_MIN or not any(c.isalnum() for c in key):
            return []
        found = prompt_text.rfind(key)
        if found < 0:
            return []
        ahead = prompt_text[found + len(key) : found + len(key) + TEXT_AHEAD]
        return self._encode(ahead)[:limit] if ahead else []


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
    observed: int = 0  # as a shadow (not fed): its guesses the answer kept that were counted already

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
    text: PromptText | None = None,
    answer_length: int = 0,
) -> Draft:
    """Up to `limit` draft tokens after `context` (the prompt, the answer and the row's pending tokens). With a
    grammar, each guess must be accepted by `matcher`, and the tokens the grammar then forces follow it (within
    `forced_room`, as jump-forward would append them); the matcher is put back as it was before returning.
    With `text` (and `index.prompt_text`), where no n-gram is found the answer's last `answer_length` tokens are
    looked up in the prompt's text. Under a grammar with `text`, punctuation is looked up alone (the answer's own
    shape: `":` is followed by ` "`), and punctuation alone never guesses a word or a number: after `", "city": "`
    a JSON answer starts a new value, and what followed `": "` earlier is another field's (on Qwen2.5's
    extraction a third of all drafts, none of them kept)."""
    draft = Draft()
    tail = context[-NGRAM_MAX:]
    origin: NgramIndex | _Copied = index
    shaped = text is not None and matcher is not None

    def vague(suffix: tuple[int, ...], following: int) -> bool:
        assert text is not None
        return text.informative(following) and not any(map(text.informative, suffix[-NGRAM_MIN:]))

    rule = vague if shaped else None
    shortest = 1 if shaped and tail and text is not None and not text.informative(tail[-1]) else NGRAM_MIN
    source = index.continuation(tail, rule, shortest)
    if source is None and text is not None and index.prompt_text is not None and answer_length:
        origin, source = _Copied(text.guesses(index.prompt_text, context[-answer_length:], limit)), 0
    accepted = 0
    looked_up = True  # the next guess is a lookup's (it judged the whole suffix), not a run's next token
    try:
        while source is not None and len(draft) < limit:
            guess = origin.token(source)
            if guess is None or guess in stop_ids or (rule is not None and not looked_up and rule(tuple(tail), guess)):
                break
            looked_up = False
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
                    following = [origin.token(source + i) for i in range(len(forced))]
                    if following != forced:
                        source, looked_up = origin.continuation(tail, rule), True
                    else:
                        source += len(forced)
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
    """A sequence's drafting: guesses fed and accepted, drafts fed, and its decayed acceptance tallies (from its
    fed drafts and its shadows alike)."""

    proposed: int = 0
    accepted: int = 0
    drafts: int = 0
    kept: float = 0.0
    refused: float = 0.0
    dense_share: float = 1.0  # of its draft places, the share whose logits need the whole vocabulary (decayed)
    shadows: int = 0  # shadow drafts whose outcome was counted (tests, profiling)

    @property
    def rate(self) -> float:
        """The chance a guess is accepted given the one before it was (Laplace's rule over decayed tallies)."""
        return (self.kept + 1.0) / (self.kept + self.refused + 2.0)

    def record(self, proposed: int, accepted: int) -> None:
        """A fed draft's outcome."""
        self.proposed += proposed
        self.accepted += accepted
        self.drafts += 1
        self.kept = self.kept * DECAY + accepted
        self.refused = self.refused * DECAY + (1.0 if accepted < proposed else 0.0)

    def observe(self, kept: int, *, refused: bool, first: bool) -> None:
        """A shadow's guesses the answer kept since its last observation, and whether the answer has now left
        it: evidence of the rate, no guess fed. A shadow is observed as the answer follows it, not only once it
        ends, so a row whose answer starts to copy drafts a step later, not after the copy. Its first
        observation ages the earlier evidence once, as a fed draft's outcome does."""
        if first:
            self.kept *= DECAY
            self.refused *= DECAY
        self.kept += kept
        self.refused += 1.0 if refused else 0.0

    def saw_places(self, places: int, sparse: int) -> None:
        """A draft's logit places under the grammar, `sparse` of them allowing few tokens."""
        if places:
            self.dense_share = self.dense_share * DECAY + (1 - DECAY) * (places - sparse) / places

    def idle(self) -> None:
        """A step it could have drafted in but did not (too unlikely to pay): the evidence ages, so a row whose
        lookups find nothing for a while goes back towards the prior."""
        self.kept *= IDLE_DECAY
        self.refused *= IDLE_DECAY


class KindHistory:
    """Drafting outcomes (fed drafts and shadows) of recent rows of one kind (free text, or under a grammar)
    across requests, where a new row of that kind starts."""

    def __init__(self) -> None:
        self.kept = 0.0
        self.refused = 0.0

    def record(self, proposed: int, accepted: int) -> None:
        self.kept = self.kept * HISTORY_DECAY + accepted
        self.refused = self.refused * HISTORY_DECAY + (1.0 if accepted < proposed else 0.0)

    def seed(self, counts: DraftCounts) -> None:
        """Start a new row's counts from this history, weighed as SEED_DRAFTS drafts at most. History only makes a
        row more cautious than the even prior: a kind whose drafts kept well still starts there, since its rows'
        steps may be batched where drafts cost more (Gemma 3's free text at c8, seeded from c1's 99 % kept, ran
        0.87x its speed without drafts)."""
        drafts = self.kept + self.refused
        if drafts > 0 and self.kept < self.refused:
            scale = min(1.0, SEED_DRAFTS / drafts)
            counts.kept, counts.refused = self.kept * scale, self.refused * scale
