"""RevisionSampler bookkeeping: take back the last step's tokens and ban the retracted choice.

The engine owns the KV cache; this class owns everything else a revision touches: the matcher
(rollback), the output tokens, the per-position bans and the depth limit. It works the same for a
revision token the model sampled and for automatic backtracking out of a dead end.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from samplers.protocol import Matcher


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

    def revise(self, output: list[int], matcher: Matcher | None) -> Revision:
        """Undo the last step: shorten `output` in place and roll the matcher back with it."""
        if not self.units:
            raise ValueError("nothing to revise: no output yet")
        count = self.units.pop()
        position = len(output) - count
        banned = output[position]
        del output[position:]
        if matcher is not None:
            matcher.rollback(count)
        # Bans further along belonged to the abandoned path; the new one starts clean.
        self.bans = {p: b for p, b in self.bans.items() if p <= position}
        self.bans.setdefault(position, set()).add(banned)
        self.revisions += 1
        return Revision(count, position, banned)

    def banned_at(self, position: int) -> set[int]:
        return self.bans.get(position, set())

    def stable_tokens(self, output_len: int) -> int:
        """Output tokens no future revision can take back (what streaming may show)."""
        if self.remaining == 0:
            return output_len
        return output_len - sum(self.units[-self.remaining :])
