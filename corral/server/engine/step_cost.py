"""The step-cost fit of speculative decoding (corral/server/engine/speculation.py): each decode step's wall time
as a sum of parts (fixed, per fed token, per dense logit row, per draft place, per row, a head of several rows),
fitted over recent steps, and a drafted step's as the step without its guesses plus what a guess was measured to
add at as many rows, so a row drafts only as many tokens as pay for what they cost on this machine."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import numpy as np

COST_WINDOW = 256  # decode steps the step-cost fit reads
# ...of those recorded in the last COST_MAX_AGE steps: a drafted step is measured only when a row drafts, so
# without an age limit a few slow ones (a busy machine, a first request's cold caches) would keep every row from
# drafting for as long as the server runs. Forgotten, the fit falls back to its prior and a few drafted steps
# measure again (where drafts do not pay: a few steps at a loss in every COST_MAX_AGE).
COST_MAX_AGE = 4096
# Steps between refits of the step-cost fit: a fit over both windows (up to 512 steps) took ~1.5 ms of Python on
# the engine thread, every step (6 % of Gemma 3 270M's 25 ms step on 2 AMD EPYC cores); the fit moves little
# in a few steps, except when the first drafted step is measured, which refits at once.
REFIT_EVERY = 16
# A step's wall time is fitted as a sum of parts: fixed, each fed token, each logit row over the whole vocabulary
# (a dense row; a sparse row's allowed ids cost little), each draft place (its mask fill and its verification on
# the engine thread), each row (its mask, sampling and bookkeeping) and a step whose head product has more than
# one row (ggml's product of one row is its own fast kernel: the first extra row costs what the next six do;
# measured: docs/measured-choices.md#speculation-step-cost). COST_PRIOR: the parts relative to the mean
# step until the steps vary enough to read them; PRIOR_WEIGHT: how many steps' worth of evidence the prior counts
# as (ridge regression towards it). On top of that line, each count of fed tokens keeps its own measured
# difference from it (shrunk towards none by SHAPE_SHRINK steps' worth): a kernel's cost is a staircase, not a
# line (on the Xeon, ggml's quantized products take 4 rows at a time: Qwen2.5 1.5B's step of 2 tokens cost 146 ms,
# of 3 172, of 4 146, of 1 90; docs/measured-choices.md#speculation-step-cost), kept per count of rows and
# apart for drafted steps too (`_staircase`).
COST_PRIOR = (0.4, 0.15, 0.3, 0.05, 0.05, 0.1)
# What a guess costs, as a share of the step without drafts, until a drafted step of as many rows is measured: on
# this project's CPUs a guess cost 0.3-0.9 of a one-row step (docs/speculation.md), so a row whose guesses are kept
# often tries a draft and measures it; at 8 rows a guess priced at half the batch's step never pays, as there a
# step is bound by arithmetic already.
GUESS_PRIOR = 0.5
PRIOR_WEIGHT = 1.0
SHAPE_SHRINK = 2.0


@dataclass(frozen=True)
class StepShape:
    """What a decode step computed: the regressors of its time."""

    tokens: int
    dense_rows: float  # a planned draft's share of dense places may be fractional
    draft_places: int
    rows: int

    def grown(self, tokens: int, dense_rows: float) -> StepShape:
        """This step with a draft of `tokens` more (each a draft place), `dense_rows` of them dense."""
        return StepShape(self.tokens + tokens, self.dense_rows + dense_rows, self.draft_places + tokens, self.rows)

    def features(self) -> list[float]:
        return [1.0, self.tokens, self.dense_rows, self.draft_places, self.rows, float(self.dense_rows > 1)]


@dataclass(frozen=True)
class CostParts:
    """Milliseconds per part of a step (see COST_PRIOR); never negative."""

    fixed: float
    per_token: float
    per_dense_row: float
    per_place: float
    per_row: float
    multi_row: float = 0.0  # a head product of more than one row, once per step
    # {(r, n): the measured plain steps of r rows and n fed tokens' mean difference from the line}; a plain shape
    # not measured reads the line alone. Not the nearest measured shape's difference: on Qwen2.5 a plain step's sits
    # far below a line that prompts pull down to ~8 ms a token, where a drafted token costs ~30 ms at one row, and
    # read at a draft's shape it priced every draft at the prompts' rate (free text at c1 ran 0.83x without drafts).
    by_shape: Mapping[tuple[int, int], float] = field(default_factory=dict)
    # {r: ms a guess adds to a step of r rows}, from the drafted steps measured at r rows (see `_with_drafted`).
    per_guess: Mapping[int, float] = field(default_factory=dict)
    # {(r, n): the measured drafted steps' mean difference from that price}, as `by_shape` is for plain steps.
    drafted_by_shape: Mapping[tuple[int, int], float] = field(default_factory=dict)
    guess_share: float = GUESS_PRIOR  # a guess's cost at a row count without a measured drafted step

    def step_ms(self, shape: StepShape) -> float:
        return self.grown_ms(shape, 0, 0.0)

    def plain_ms(self, rows: int, fed: int, dense: float) -> float:
        """A step of `rows` rows feeding `fed` tokens, `dense` logit rows over the whole vocabulary, no draft."""
        ms = (self.fixed + self.per_token * fed + self.per_dense_row * dense + self.per_row * rows
              + (self.multi_row if dense > 1 else 0.0))
        return max(float(ms + self.by_shape.get((rows, fed), 0.0)), 0.0)

    def grown_ms(self, shape: StepShape, tokens: int, dense_rows: float) -> float:
        """`step_ms(shape.grown(tokens, dense_rows))`, without making the grown shape: every row of every step
        asks this for each draft length it weighs, on the engine thread (spelled out, not `features()`'s
        dot product, for the same reason).

        A drafted step is priced as the step without its guesses plus each guess at the cost measured for drafted
        steps of as many rows, not by the line: for plain decode steps the fed tokens, dense rows and rows move
        together, so the line's split between them is the ridge's guess, and read at a draft's shape it swung
        between refits from below a draft's cost (Gemma 3's c8 free text fed drafts in 61 ms steps against 45
        without them) to three times it (Qwen2.5's and Gemma 3's extraction at c1 stopped drafting)."""
        fed, dense, places = shape.tokens + tokens, shape.dense_rows + dense_rows, shape.draft_places + tokens
        if not places:
            return self.plain_ms(shape.rows, fed, dense)
        base = self.plain_ms(shape.rows, fed - places, max(dense - places, 0.0))
        guess = self.per_guess.get(shape.rows)
        if guess is None:  # no drafted step of this many rows measured yet
            guess = self.guess_share * base
        return max(base + places * guess + self.drafted_by_shape.get((shape.rows, fed), 0.0), 0.0)


class StepCost:
    """Decode steps' wall times (drafting, forward, verification) fitted by least squares over recent steps: the
    last COST_WINDOW steps that fed a draft and the last COST_WINDOW that did not (each within COST_MAX_AGE steps),
    so that what drafts cost is remembered once drafts stop. With one window, a few requests without drafts pushed
    every drafted step out, the fit fell back to its prior (a draft token at half a step), and rows drafted at a
    loss again: Qwen2.5's extraction on the AMD EPYC, where a fed token costs a whole step, ran 0.87x its speed
    without drafts."""

    def __init__(self) -> None:
        self._plain: deque[tuple[StepShape, float, int]] = deque(maxlen=COST_WINDOW)
        self._drafted: deque[tuple[StepShape, float, int]] = deque(maxlen=COST_WINDOW)
        self._steps = 0  # steps recorded so far: each sample's age is read from it
        self._fit: tuple[int, CostParts] | None = None  # the last fit and the step it was made at
        self._seen: set[tuple[int, int, bool]] = set()  # the shapes whose first step has run

    def record(self, shape: StepShape, ms: float) -> None:
        self._steps += 1
        key = (shape.rows, shape.tokens, shape.draft_places > 0)
        if key not in self._seen:
            # A shape's first step builds its graphs (the decoder's for its token count, the head's for its rows):
            # on Gemma 3 270M at one row drafted steps of 2, 3 and 4 guesses took 54, 61 and 89 ms the first time
            # and 31, 33 and 48 after. Counted, one such step priced every guess at 2-3 times its cost, and the
            # rows stopped drafting before a warm step was measured.
            self._seen.add(key)
            return
        if shape.draft_places and not self._drafted:  # the first drafted step replaces the prior's guess at once
            self._fit = None
        (self._drafted if shape.draft_places else self._plain).append((shape, ms, self._steps))

    def drafted_steps(self, rows: int, tokens: int) -> int:
        """Drafted steps of this many rows and fed tokens in the window (the shape's first, unrecorded, aside)."""
        return sum(1 for shape, _, _ in self._drafted if (shape.rows, shape.tokens) == (rows, tokens))

    def parts(self) -> CostParts:
        """The fit, made again once REFIT_EVERY steps have been recorded since the last."""
        if self._fit is None or self._steps - self._fit[0] >= REFIT_EVERY:
            self._fit = (self._steps, self._fitted())
        return self._fit[1]

    def _fitted(self) -> CostParts:
        oldest = self._steps - COST_MAX_AGE
        steps = [(shape, ms) for shape, ms, at in [*self._plain, *self._drafted] if at > oldest]
        if not steps:
            return CostParts(*COST_PRIOR)
        features = np.array([s.features() for s, _ in steps])
        times = np.array([ms for _, ms in steps])
        prior = np.array(COST_PRIOR) * float(times.mean())
        # Ridge towards the prior: min |X t - y|^2 + w |t - prior|^2, whose normal equations are these.
        weight = PRIOR_WEIGHT * np.eye(len(COST_PRIOR))
        fitted = np.maximum(np.linalg.solve(features.T @ features + weight, features.T @ times + weight @ prior),
                            0.01 * prior)
        residual = times - features @ fitted
        fixed, per_token, per_dense_row, per_place, per_row, multi_row = (float(v) for v in fitted)
        plain = [i for i, (s, _) in enumerate(steps) if not s.draft_places]
        line = CostParts(fixed, per_token, per_dense_row, per_place, per_row, multi_row,
                         _staircase([(steps[i][0].rows, steps[i][0].tokens) for i in plain], residual[plain]))
        return _with_drafted(line, [(s, ms) for s, ms in steps if s.draft_places])


def _with_drafted(line: CostParts, drafted: list[tuple[StepShape, float]]) -> CostParts:
    """`line` with what drafted steps cost over the step without their guesses: per guess, by count of rows (the
    sum of the steps' excess over their guesses'; a row count without a drafted step reads GUESS_PRIOR), and each
    measured drafted shape's difference from that."""
    bases = [line.plain_ms(s.rows, s.tokens - s.draft_places, max(s.dense_rows - s.draft_places, 0.0))
             for s, _ in drafted]
    excess: dict[int, float] = {}
    guesses: dict[int, int] = {}
    for (shape, ms), base in zip(drafted, bases, strict=True):
        excess[shape.rows] = excess.get(shape.rows, 0.0) + ms - base
        guesses[shape.rows] = guesses.get(shape.rows, 0) + shape.draft_places
    per_guess = {rows: max(total / guesses[rows], 0.0) for rows, total in excess.items()}
    residual = np.array([ms - base - s.draft_places * per_guess[s.rows]
                         for (s, ms), base in zip(drafted, bases, strict=True)])
    return replace(line, per_guess=per_guess,
                   drafted_by_shape=_staircase([(s.rows, s.tokens) for s, _ in drafted], residual))


def _staircase(shapes: list[tuple[int, int]], residual: np.ndarray) -> dict[tuple[int, int], float]:
    """Each (rows, fed tokens)'s mean difference from the price, shrunk towards none by SHAPE_SHRINK steps' worth.

    Keyed by rows: a step of 9 tokens in one row (a stream's draft) costs a fraction of one of 9 tokens over 8 rows,
    and with the token count alone, cheap drafted steps at c1 made every draft at c8 look nearly free (Gemma 3's
    free text at c8 ran 0.74x its speed without drafts in `corral bench serve`, 2026-12-04). Plain and drafted
    steps keep staircases apart: a plain step of one row and 2 tokens (a grammar's forced token after the pick)
    runs its head on one row, a drafted one on two, apart from the decoder's graph; on Gemma 3 270M through
    `corral serve` they took 12.3 and 25.5 ms (medians, 2026-12-04), and under one key they priced the draft near
    the plain step."""
    sums: dict[tuple[int, int], float] = {}
    counts: dict[tuple[int, int], int] = {}
    for shape, value in zip(shapes, residual.tolist(), strict=True):
        sums[shape] = sums.get(shape, 0.0) + value
        counts[shape] = counts.get(shape, 0) + 1
    return {shape: total / (counts[shape] + SHAPE_SHRINK) for shape, total in sums.items()}
