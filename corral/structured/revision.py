"""RevisionSampler bookkeeping: take back the last step's tokens and ban the retracted choice.

The engine owns the KV cache; this class owns everything else a revision touches: the matcher
(rollback), the output tokens, the per-position bans and the depth limit. It works the same for a
revision token the model sampled and for automatic backtracking out of a dead end.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from corral.grammar_engines.protocol import Matcher

# Called with the matcher rolled back to the start of a step: is a token other than these allowed there?
ChoiceProbe = Callable[[set[int]], bool]


@dataclass
class Revision:
    """What one revision did: `retracted` tokens removed from the end; `banned` is now forbidden at
    output position `position` (the first retracted token, the one the sampler chose)."""

    retracted: int
    position: int
    banned: int


@dataclass
class RevisionTracker:
    max_revisions: int
    revisions: int = 0
    units: list[int] = field(default_factory=list)  # tokens appended per step (sampled + forced)
    bans: dict[int, set[int]] = field(default_factory=dict)

    def record(self, count: int) -> None:
        self.units.append(count)

    @property
    def remaining(self) -> int:
        return max(0, self.max_revisions - self.revisions)

    def can_revise(self) -> bool:
        return self.remaining > 0 and bool(self.units)

    def revise(
        self, output: list[int], matcher: Matcher | None, has_choice: ChoiceProbe | None = None
    ) -> Revision | None:
        """Undo the latest step whose first token had an alternative, with every step after it: shorten
        `output` in place, roll the matcher back with it and ban that token at its position. A step the
        grammar dictated (one allowed token, e.g. the opening of a JSON object) cannot go differently, and
        banning its token would be a dead end at once. `has_choice` answers for the step under the rolled-
        back matcher; None means every step had a choice. Each step taken back counts as one revision, so
        a search never reaches past the last `remaining` steps (what `stable_tokens` keeps from streaming).
        Returns None, changing nothing, when none of those steps had a choice."""
        if not self.units:
            raise ValueError("nothing to revise: no output yet")
        position = len(output)
        for index in range(len(self.units) - 1, max(-1, len(self.units) - 1 - self.remaining), -1):
            count = self.units[index]
            if matcher is not None:
                matcher.rollback(count)
            position -= count
            banned = output[position]
            if has_choice is None or has_choice(self.banned_at(position) | {banned}):
                return self._retract(output, index, position)
        if matcher is not None:  # every step was dictated: put the matcher back where it was
            for token in output[position:]:
                matcher.accept_token(token)
        return None

    def _retract(self, output: list[int], index: int, position: int) -> Revision:
        banned = output[position]
        retracted = len(output) - position
        del output[position:]
        self.revisions += len(self.units) - index
        del self.units[index:]
        # Bans further along belonged to the abandoned path; the new one starts clean.
        self.bans = {p: b for p, b in self.bans.items() if p <= position}
        self.ban(position, banned)
        return Revision(retracted, position, banned)

    def ban(self, position: int, token: int) -> None:
        self.bans.setdefault(position, set()).add(token)

    def banned_at(self, position: int) -> set[int]:
        return self.bans.get(position, set())

    def stable_tokens(self, output_len: int) -> int:
        """Output tokens no future revision can take back (what streaming may show)."""
        if self.remaining == 0:
            return output_len
        return output_len - sum(self.units[-self.remaining :])
