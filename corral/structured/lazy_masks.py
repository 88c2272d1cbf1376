"""Grammar masks only where a greedy pick needs one: rows in wide, costly grammar states pick first and are
checked after.

A mask costs its fill: the grammar engine walks the vocabulary's token trie, and where a state allows most of the
vocabulary (an SQL identifier, a CSV field, free words under a regex) that is 1-3 ms a row on Gemma 3's 262,144
tokens (measured: docs/measured-choices.md#lazy-masks). Fills run on a worker thread beside the forward, but on two
cores the forward uses both, so eight such rows a step slow the step itself. A greedy row's masked pick is its
unmasked pick whenever that token is allowed (the best of all tokens, if allowed, is the best of the allowed ones).
So a row whose last mask was wide and costly skips the fill; it is picked from its full logits and the token is
checked with one `validate_tokens` call. Only a refused token costs the fill, then, on the engine thread, and the
row is picked again under its mask: the same token as a masked step would have given, either way.

Which rows: greedy ones that report no logprobs (a sampled row's draw, and reported logprobs, are over the
masked distribution), whose last filled mask allowed more than the sparse-head limit (a sparse row's head
computes only its allowed ids, which needs its mask first) and took at least `min_fill_us`. A stop token is
always refused here (the mask decides whether the answer may end, the contract guard with it). A refusal
backs the row off for a few steps, doubling with each refusal in a row, and a row that skipped `MAX_STREAK` fills
running gets one mask, to see whether its state narrowed.

A row's own back-off cannot learn within a short answer, so each grammar also keeps the odds that its checks
pass (`GrammarOdds`, shared by every request of that grammar). A model whose picks a grammar mostly refuses (a
random model's, or one that ignores a prompt's format) would pay a serial fill after every skipped one, on the
engine thread and after the forward, instead of the fill that overlaps it: under such a grammar rows skip only
one eligible step in `PROBE_EVERY`, which keeps the odds current.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

from corral.server.engine.sampling import SamplingParams

# Only costly fills skip: a cheap one overlaps the forward well enough, and a state that narrows during a run of
# skipped fills computes its full head row where its mask would have cut it to a few ids. The threshold sits above
# JSON Schema's fills, whose skips cost their answers tokens per second, and below wide grammars' (SQL, CSV), whose
# skips gained (measured on Gemma 3 at concurrency 8: docs/measured-choices.md#lazy-masks).
MIN_FILL_US = 1500.0
MAX_STREAK = 16  # unmasked picks in a row before one masked step re-reads how wide the state is
MISS_BACKOFF = 4  # masked steps after a refused pick, doubled per refusal in a row ...
MAX_BACKOFF = 256  # ... up to this
# A grammar's odds: a moving average of its checks (each new one weighs ODDS_WEIGHT), starting hopeful. Below
# MIN_ODDS its rows skip one eligible step in PROBE_EVERY. At most GRAMMARS_KEPT grammars are remembered.
ODDS_WEIGHT = 0.1
MIN_ODDS = 0.5
PROBE_EVERY = 16
GRAMMARS_KEPT = 256


@dataclass
class GrammarOdds:
    """How often the checks of one grammar's unmasked picks passed, over every request of that grammar."""

    passed: float = 1.0  # moving average of 1 (allowed) and 0 (refused)
    eligible: int = 0  # steps on which a row of this grammar could have skipped its fill

    def worth_skipping(self) -> bool:
        self.eligible += 1
        return self.passed >= MIN_ODDS or self.eligible % PROBE_EVERY == 0

    def record(self, allowed: bool) -> None:
        self.passed += ODDS_WEIGHT * ((1.0 if allowed else 0.0) - self.passed)


@dataclass
class LazyMaskState:
    """One sequence's standing: whether its next step may skip the fill, and how often it did."""

    wide: bool = False  # its last filled mask allowed many tokens and cost at least the threshold
    streak: int = 0  # unmasked picks since the last fill
    misses: int = 0  # refused picks in a row
    resume_at: int = 0  # output length from which it may skip again (after a refusal)
    skipped: int = 0  # fills skipped (the pick was allowed)
    refilled: int = 0  # fills done after a refused pick


class LazyMasks:
    """The policy: which rows skip their fill this step, and what each fill or check says about the next."""

    def __init__(self, wide_above: int, *, enabled: bool = True, min_fill_us: float = MIN_FILL_US) -> None:
        """wide_above: allowed tokens past which a mask counts as wide (the sparse-head limit)."""
        self.wide_above, self.enabled, self.min_fill_us = wide_above, enabled, min_fill_us
        self._odds: OrderedDict[Hashable, GrammarOdds] = OrderedDict()

    def odds(self, grammar: Hashable) -> GrammarOdds:
        """`grammar`'s odds (any key naming the compiled grammar), remembered for the most recent grammars."""
        found = self._odds.get(grammar)
        if found is None:
            found = self._odds[grammar] = GrammarOdds()
            if len(self._odds) > GRAMMARS_KEPT:
                self._odds.popitem(last=False)
        else:
            self._odds.move_to_end(grammar)
        return found

    def skips(
        self, state: LazyMaskState, params: SamplingParams, *, grammar: Hashable | None, produced: int
    ) -> bool:
        """Whether a sequence (`produced` output tokens so far, under `grammar`, None when unconstrained) skips
        its fill this step."""
        return (
            self.enabled
            and grammar is not None
            and state.wide
            and state.streak < MAX_STREAK
            and produced >= state.resume_at
            and params.greedy
            and not params.logprobs
            and self.odds(grammar).worth_skipping()
        )

    def filled(self, state: LazyMaskState, allowed: int, fill_us: float) -> None:
        """A mask was filled: `allowed` tokens, at `fill_us`."""
        state.wide = allowed > self.wide_above and fill_us >= self.min_fill_us
        state.streak = 0

    def checked(self, state: LazyMaskState, grammar: Hashable, allowed: bool, produced: int) -> None:
        """An unmasked pick was checked: allowed (the step needed no mask) or refused (back off)."""
        self.odds(grammar).record(allowed)
        if allowed:
            state.streak += 1
            state.misses = 0
            state.skipped += 1
            return
        state.resume_at = produced + min(MISS_BACKOFF << min(state.misses, 16), MAX_BACKOFF)
        state.misses += 1
        state.refilled += 1
