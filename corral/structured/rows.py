"""A row's structured-output life in the engine: what it carries from admission, how the stall watchdog sees its
tokens, and taking back its last step (revision and backtracking).

The engine calls these and applies what they decide (a trip ends the row); the row's KV positions are the
engine's, so taking back a step only says which tokens to feed again.
"""

from __future__ import annotations

from collections.abc import Callable

from corral.server.engine.sequence import Sequence
from corral.structured.revision import ChoiceProbe, RevisionTracker
from corral.structured.watchdog import MaskBudget, StallDetector, Trip, WatchdogLimits, dictated

UNRECOVERABLE = "the grammar allows no token here and no revision could recover"


def admit(seq: Sequence, limits: WatchdogLimits, max_revisions: int, is_whitespace: Callable[[int], bool]) -> None:
    """Give an admitted row its revision depth, mask budget and stall detector."""
    p = seq.params
    seq.revision = RevisionTracker(max_revisions if p.max_revisions is None else p.max_revisions)
    seq.mask_budget = MaskBudget(limits)
    # ignore_eos asks to run to max_tokens (benchmarks): loops are the point there, not a fault.
    seq.stall = None if p.ignore_eos else StallDetector(limits, is_whitespace)


def observe(
    seq: Sequence, appended: list[int], narrow: list[int] | None, token_text: Callable[[int], str]
) -> tuple[list[bool], bool]:
    """Which of the step's `appended` tokens the model chose, and whether the row now stalls. Only the model's
    own choices can make a loop: jump-forward tokens, and a sampled token every allowed alternative agreed with
    (`narrow`: the few tokens its mask allowed), were the grammar's."""
    chosen = [not dictated(appended[0], narrow, token_text), *([False] * (len(appended) - 1))]
    seq.revision.record(len(appended))
    return chosen, seq.stall is not None and seq.stall.observe(appended, chosen)


def take_back(
    seq: Sequence, trip_if_unable: Trip, revise_id: int | None, probe: ChoiceProbe | None
) -> tuple[Trip, str] | None:
    """Take back the last step (matcher, output, what to feed again) and ban its choice at that position: for a
    sampled revision token and for backing out of a dead end. Returns the trip that ends the row where it cannot."""
    if not seq.revision.can_revise():
        too_many = f"more than {seq.revision.max_revisions} revisions"
        return trip_if_unable, UNRECOVERABLE if trip_if_unable is Trip.DEAD_END else too_many
    if seq.revision.revise(seq.output_ids, seq.matcher, probe) is None:
        if trip_if_unable is Trip.DEAD_END:
            return Trip.DEAD_END, UNRECOVERABLE
        # The model asked to revise, but the grammar dictated every token so far: nothing could go differently.
        # Refuse it at this position and run the step again.
        assert revise_id is not None
        seq.revision.ban(len(seq.output_ids), revise_id)
    del seq.logprobs[len(seq.output_ids) :]  # the retracted tokens' entries go with them
    # Re-feed the last kept token: its KV position is rewritten with identical values and its logits are exactly
    # those a fresh prefill of the kept tokens would give.
    kept_last = seq.output_ids[-1] if seq.output_ids else seq.prompt_ids[-1]
    seq.num_cached = len(seq.prompt_ids) + len(seq.output_ids) - 1
    seq.pending = [kept_last]
    if seq.stall is not None:
        seq.stall.reset()
    return None
