"""The engine's structured-output stage: per step, start the grammar masks, settle and judge them, apply them.

Masks are filled on a worker thread while the forward runs; settling waits for them and sorts each row
into sampled, ended (failed fill, budget overrun) or backing off (dead end). This stage changes no
sequence: the engine acts on what `SettledMasks` reports once the forward is done.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable
from concurrent.futures import Future
from typing import NamedTuple

import numpy as np
import torch

from corral.grammar_engines.bitmask import allowed_counts, apply_bitmask, sparse_limit, unpack_rows
from corral.grammar_engines.protocol import Matcher, SamplerBackend, allocate_bitmask
from corral.server.engine.sequence import Sequence
from corral.server.torch_threads import helper_pool
from corral.structured.lazy_masks import LazyMasks
from corral.structured.revision import ChoiceProbe
from corral.structured.watchdog import FEW_ALLOWED

log = logging.getLogger(__name__)


class MaskFill(NamedTuple):
    per_row_us: dict[int, float]  # rows filled, each with its share of the fill time
    failed: dict[int, str]  # rows whose grammar engine raised, with the message their request ends with


class SettledMasks(NamedTuple):
    rows: list[int]  # rows that carry a grammar mask this step
    failed: dict[int, str]  # rows whose fill raised, with their request's error
    overran: set[int]  # rows whose fills overran their time budget too often
    dead_ends: set[int]  # rows whose grammar allows nothing: they back off (revision)
    restricted: dict[int, torch.Tensor]  # rows whose head computes only these token ids
    narrow: dict[Sequence, list[int]]  # the few tokens a row's mask allowed (the stall check reads them)

    @property
    def dead(self) -> set[int]:
        """Rows not sampled this step."""
        return set(self.failed) | self.overran | self.dead_ends


NO_MASKS = SettledMasks([], {}, set(), set(), {}, {})
_NO_TOKENS = torch.zeros(0, dtype=torch.int64)
_Group = tuple[SamplerBackend, list[Matcher], list[int]]


class Recheck(NamedTuple):
    """An unmasked pick after its check: the token to take (None: the grammar allows nothing, a dead end), and
    whether the fill a refused pick needed overran the row's budget too often."""

    token: int | None
    overran: bool = False


class StructuredOutput:
    """Owns the step's bitmask and the thread that fills it. Engine thread only, except `_fill`."""

    def __init__(
        self,
        max_batch: int,
        vocab_size: int,
        revise_id: int | None,
        stop_ids: torch.Tensor,
        *,
        lazy_masks: bool = True,
    ) -> None:
        """lazy_masks: greedy rows in wide, costly grammar states skip their fill
        (corral/structured/lazy_masks.py)."""
        self.vocab = vocab_size
        self.revise_id = revise_id
        self.bitmask = allocate_bitmask(max_batch, vocab_size)
        self._probe = allocate_bitmask(1, vocab_size)  # revisions ask the grammar on this row
        self._ban_stop = stop_ids
        self._stops = frozenset(int(t) for t in stop_ids.tolist())
        self.lazy = LazyMasks(sparse_limit(vocab_size), enabled=lazy_masks)
        self.unmasked: list[int] = []  # the step's rows that skipped their fill: checked after the pick
        # Masks are filled on this worker while the forward runs on the engine thread; both the
        # engines' fill calls and torch's kernels release the GIL, so the two really overlap.
        self._pool = helper_pool(1, "corral-mask")

    def start(self, batch: list[Sequence]) -> Future[MaskFill] | None:
        """Start filling the step's masks, but for the rows that skip theirs (`unmasked`)."""
        groups: dict[int, _Group] = {}
        skips = self.lazy.skips
        self.unmasked = [
            row
            for row, seq in enumerate(batch)
            if skips(seq.lazy_mask, seq.params, grammar=odds_key(seq), produced=len(seq.output_ids))
        ]
        skipped = set(self.unmasked)
        for row, seq in enumerate(batch):
            if seq.matcher is not None and seq.backend is not None and row not in skipped:
                entry = groups.setdefault(id(seq.backend), (seq.backend, [], []))
                entry[1].append(seq.matcher)
                entry[2].append(row)
        if not groups:
            return None
        return self._pool.submit(self._fill, list(groups.values()))

    def _fill(self, groups: list[_Group]) -> MaskFill:
        """Fill each backend's rows in one batched call; returns µs per row (the group's time / rows).
        A batched call that raises is retried row by row, so only the rows that fail on their own fail."""
        per_row: dict[int, float] = {}
        failed: dict[int, str] = {}
        for backend, matchers, rows in groups:
            t0 = time.perf_counter()
            try:
                backend.fill_bitmasks(matchers, self.bitmask, rows)
            except Exception:
                log.exception("%s failed to fill a batch of %d masks; filling them one by one", backend.name, len(rows))
                for matcher, row in zip(matchers, rows, strict=True):
                    try:
                        matcher.fill_bitmask(self.bitmask, row)
                    except Exception as exc:
                        failed[row] = f"the {backend.name} grammar engine failed: {type(exc).__name__}: {exc}"
            each = (time.perf_counter() - t0) * 1e6 / len(rows)
            per_row.update({row: each for row in rows if row not in failed})
        return MaskFill(per_row, failed)

    def settle(self, batch: list[Sequence], masks: Future[MaskFill] | None, *, restrictable: bool) -> SettledMasks:
        """Wait for the step's masks and judge them: failed fills, budget overruns, dead ends, the revision
        token's bit. It may run mid-forward (between the decoder and its head), so it changes no sequence
        beyond its statistics. When `restrictable` (the runner asked, between decoder and head), it also
        names the allowed ids of each surviving row whose mask allows few tokens: the head computes only those."""
        if masks is None:
            return NO_MASKS
        per_row, failed = masks.result()
        rows = sorted(per_row)
        # One popcount over the step's rows; only rows that allow few tokens are unpacked (those the watchdog
        # checks for a dictated choice, and, when the head can be cut, those it cuts).
        most = max(sparse_limit(self.vocab), FEW_ALLOWED) if restrictable else FEW_ALLOWED
        counts, unpacked = unpack_rows(self.bitmask, rows, self.vocab, most)
        narrow = {
            batch[row]: ids.tolist()
            for row, ids in unpacked.items()
            if len(ids) <= FEW_ALLOWED and batch[row].stall is not None
        }
        overran: set[int] = set()
        dead_ends: set[int] = set()
        revisable: set[int] = set()
        for row in rows:
            seq = batch[row]
            seq.stats.mask_us.append(per_row[row])
            self.lazy.filled(seq.lazy_mask, counts[row], per_row[row])
            assert seq.mask_budget is not None
            if seq.mask_budget.record(per_row[row]):
                overran.add(row)
            elif counts[row] == 0:
                dead_ends.add(row)  # backtrack: the grammar allows nothing here
            elif self.revise_id is not None and seq.revision.can_revise():
                set_bit(self.bitmask, row, self.revise_id)  # revision stays possible under any grammar
                revisable.add(row)
        settled = SettledMasks(rows, failed, overran, dead_ends, {}, narrow)
        if restrictable:
            settled.restricted.update(self._restrictions(settled, unpacked, revisable))
        return settled

    def _restrictions(
        self, settled: SettledMasks, unpacked: dict[int, np.ndarray], revisable: set[int]
    ) -> dict[int, torch.Tensor]:
        """A row that ends here needs no logits at all; a sparse one only its allowed ids."""
        dead = settled.dead
        restricted = dict.fromkeys(dead, _NO_TOKENS)
        for row, ids in unpacked.items():
            if row in dead:
                continue
            if row in revisable and self.revise_id is not None and self.revise_id < self.vocab:
                at = int(np.searchsorted(ids, self.revise_id))  # kept ascending: greedy ties go low
                if at == len(ids) or ids[at] != self.revise_id:
                    ids = np.insert(ids, at, self.revise_id)
            restricted[row] = torch.from_numpy(ids)
        return restricted

    def apply(self, logits: torch.Tensor, batch: list[Sequence], settled: SettledMasks) -> tuple[list[int], list[int]]:
        """Mask every row; returns (rows that go on to sampling, rows a ban left with no token: dead ends).
        Rows that ended or back off this step (`settled.dead`) are in neither."""
        for row, seq in enumerate(batch):  # index_fill_: ~3 µs a Qwen row, indexing the batch ~10
            if seq.matcher is None and seq.params.ignore_eos:
                logits[row].index_fill_(0, self._ban_stop, float("-inf"))
        # Restricted rows came out of the head already masked.
        unmasked = [row for row in settled.rows if row not in settled.restricted]
        if unmasked:
            apply_bitmask(logits, self.bitmask[: len(batch)], unmasked)
        dead = settled.dead
        live = [i for i in range(len(batch)) if i not in dead]
        for row in live:
            seq = batch[row]
            banned = seq.revision.banned_at(len(seq.output_ids))
            if banned:
                logits[row, list(banned)] = float("-inf")
            if self.revise_id is not None and not seq.revision.units:
                logits[row, self.revise_id] = float("-inf")  # nothing to take back yet
        # A ban can remove the last allowed token: that is a dead end too.
        stuck = [i for i in live if batch[i].revision.bans and bool(torch.isinf(logits[i]).all())]
        return [i for i in live if i not in stuck], stuck

    def recheck(self, seq: Sequence, row: int, token: int, logits: torch.Tensor) -> Recheck:
        """The token a greedy row that skipped its fill takes: `token`, its unmasked pick, if the grammar allows
        it; else the best allowed one of `logits` (its row [V], as the pick saw it: masked here in place)."""
        matcher = seq.matcher
        assert matcher is not None
        revisable = self.revise_id is not None and seq.revision.can_revise()
        if token == self.revise_id:
            allowed = revisable  # a masked row allows it whenever the row may revise
        else:  # whether the answer may end is the mask's call (and the contract guard's), never the check's
            allowed = token not in self._stops and matcher.validate_tokens([token]) == 1
        self.lazy.checked(seq.lazy_mask, odds_key(seq), allowed, len(seq.output_ids))
        if allowed:
            return Recheck(token)
        t0 = time.perf_counter()
        matcher.fill_bitmask(self.bitmask, row)
        fill_us = (time.perf_counter() - t0) * 1e6
        seq.stats.mask_us.append(fill_us)
        assert seq.mask_budget is not None
        overran = seq.mask_budget.record(fill_us)
        count = allowed_counts(self.bitmask, [row])[0]
        self.lazy.filled(seq.lazy_mask, count, fill_us)
        if count == 0:
            return Recheck(None, overran)
        if revisable and self.revise_id is not None:
            set_bit(self.bitmask, row, self.revise_id)
        line = logits.view(1, -1)
        apply_bitmask(line, self.bitmask[row : row + 1])
        return Recheck(int(torch.argmax(line[0])), overran)

    def choice_probe(self, seq: Sequence) -> ChoiceProbe | None:
        """Whether the grammar, where `seq`'s matcher now stands, allows a token outside `taken` (the
        revision token aside). Runs only when a revision happens, on a bitmask row of its own."""
        matcher = seq.matcher
        if matcher is None:
            return None  # unconstrained: the whole vocabulary is a choice
        revise_id = self.revise_id

        def has_choice(taken: set[int]) -> bool:
            matcher.fill_bitmask(self._probe, 0)
            for token in taken | ({revise_id} if revise_id is not None else set()):
                set_bit(self._probe, 0, token, on=False)
            return bool(self._probe.any())

        return has_choice

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def odds_key(seq: Sequence) -> Hashable | None:
    """What a sequence's grammar odds are kept under (corral/structured/lazy_masks.py): the compiled grammar's
    backend and spec, shared by every request of that grammar; the matcher itself for a caller that built one
    without a compiled grammar; None when unconstrained."""
    if seq.matcher is None:
        return None
    if seq.grammar is None:
        return id(seq.matcher)
    return (seq.grammar.backend_name, seq.grammar.spec)


def set_bit(bitmask: torch.Tensor, row: int, token: int, on: bool = True) -> None:
    word, bit = divmod(token, 32)
    current = int(bitmask[row, word].item()) & 0xFFFFFFFF
    value = current | (1 << bit) if on else current & ~(1 << bit)
    bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value  # keep it a valid int32
