"""Grammar masks only where a greedy pick needs one: rows in wide, costly grammar states pick first and are
checked after.

A mask costs its fill: the grammar engine walks the vocabulary's token trie, and where a state allows most of
the vocabulary (an SQL identifier, a CSV field, free words under a regex) that is 1-3 ms a row on Gemma 3's
262,144 tokens. Fills run on a worker thread beside the forward, but on two cores the forward uses both, so
eight such rows a step slow the step itself. A greedy row's masked pick is its unmasked pick whenever that
token is allowed (the best of all tokens, if allowed, is the best of the allowed ones). So a row whose last
mask was wide and costly skips the fill; it is picked from its full logits and the token is checked with one
`validate_tokens` call. Only a refused token costs the fill, then, on the engine thread, and the row is picked
again under its mask: the same token as a masked step would have given, either way.

Which rows: greedy ones that report no logprobs (a sampled row's draw, and reported logprobs, are over the
masked distribution), whose last filled mask allowed more than the sparse-head limit (a sparse row's head
computes only its allowed ids, which needs its mask first) and took at least `min_fill_us`. A stop token is
always refused here (the mask decides whether the answer may end, the contract guard with it). A refusal
backs the row off for a few steps, doubling with each refusal in a row (a random model's picks are mostly
refused), and a row that skipped `MAX_STREAK` fills running gets one mask, to see whether its state narrowed.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.engine.sampling import SamplingParams

# Only costly fills skip: a cheap one overlaps the forward well enough, and a state that narrows during a run of
# skipped fills computes its full head row where its mask would have cut it to a few ids. Measured on Gemma 3
# at concurrency 8 (fp16, this machine): from 500 µs, JSON Schema answers (fills ~50-500 µs a row) skipped ~500
# fills per 96 requests and lost 2-10 % of their tokens per second; from 1,500 µs they skip ~20 and grammars
# (SQL, CSV: 1-3 ms) still skip ~530 per 48 requests, +20 % tokens per second.
MIN_FILL_US = 1500.0
MAX_STREAK = 16  # unmasked picks in a row before one masked step re-reads how wide the state is
MISS_BACKOFF = 4  # masked steps after a refused pick, doubled per refusal in a row ...
MAX_BACKOFF = 256  # ... up to this


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

    def skips(self, state: LazyMaskState, params: SamplingParams, *, constrained: bool, produced: int) -> bool:
        """Whether a sequence (`produced` output tokens so far) skips its fill this step."""
        return (
            self.enabled
            and constrained
            and state.wide
            and state.streak < MAX_STREAK
            and produced >= state.resume_at
            and params.greedy
            and not params.logprobs
        )

    def filled(self, state: LazyMaskState, allowed: int, fill_us: float) -> None:
        """A mask was filled: `allowed` tokens, at `fill_us`."""
        state.wide = allowed > self.wide_above and fill_us >= self.min_fill_us
        state.streak = 0

    def checked(self, state: LazyMaskState, allowed: bool, produced: int) -> None:
        """An unmasked pick was checked: allowed (the step needed no mask) or refused (back off)."""
        if allowed:
            state.streak += 1
            state.misses = 0
            state.skipped += 1
            return
        state.resume_at = produced + min(MISS_BACKOFF << min(state.misses, 16), MAX_BACKOFF)
        state.misses += 1
        state.refilled += 1
