"""Exact values for the logits that decide a step, where the head's kernel rounds its outputs.

torch's int8 and int4 weight-only kernels (corral/kernels/quantized_projection.py) accumulate in float32 but
return bfloat16, whose 8-bit significand holds a logit to within 2^-8 of its size (measured on Gemma 3 270M's
head: at most 0.0039 relative). Two tokens closer than that come out equal or swapped, and a greedy pick
then falls to the lower token id instead of the model's choice. Seen on `corral bench quality`'s order task:
after `"qty": ` the digits `3` (right) and `4` both read -1.1041 as logprobs, so free text wrote 3 while a
grammar-restricted row, whose few logits are computed exactly, wrote 4 — the same model giving two answers.

So after the step's masks, each row's candidates within rounding distance of its best logit are computed
again from the same quantized weights in float32 (`select`: a dot product each, a handful per row), and
written back (down to the n-th best for a row that reports its top n logprobs). Greedy picks, the ranking of
reported alternatives and their logprobs then see the values the model computed, and a restricted row and a
full row agree. (The softmax's normaliser still sums the rest as rounded: logprobs differ by ~1e-3.)
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

# Round-to-nearest bfloat16 is off by at most 2^-8 of a value; two values closer than twice that may swap.
# Four times covers the pair with room: a value's true place can be at most this far below the top.
REFINE_RELATIVE_MARGIN = 2.0**-6
# A row with more candidates than this past the depth it asks for (a flat distribution) refines only its best.
REFINE_MAX_PER_ROW = 64


def near_top(
    logits: torch.Tensor, rows: list[int], depths: list[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, columns) of each given row's finite logits within rounding distance of its `depths[i]`-th
    largest (1, the best, by default; a row that reports its top n logprobs asks for n). CPU logits.

    It runs every step on [B, vocab], so it uses numpy's max, compare and flatnonzero: torch's nonzero on the
    same mask took ~10x as long (measured: docs/measured-choices.md#logit-refinement)."""
    index, columns, _ = _near_top(logits, rows, depths)
    return index, columns


def _near_top(
    logits: torch.Tensor, rows: list[int], depths: list[int] | None
) -> tuple[torch.Tensor, torch.Tensor, set[int]]:
    """`near_top`'s (rows, columns), and the given rows cut to their best REFINE_MAX_PER_ROW (crowded)."""
    if not rows:
        empty = torch.empty(0, dtype=torch.long)
        return empty, empty, set()
    if (depths is None or all(d <= 1 for d in depths)) and len(rows) == 1:
        return _near_top_of_one(logits, rows[0])
    return _near_top_of_many(logits, rows, depths)


def _near_top_of_one(logits: torch.Tensor, row: int) -> tuple[torch.Tensor, torch.Tensor, set[int]]:
    """One row that asks for its best only (a single stream's step): the same search in as few numpy calls as it
    takes. Each call right after a decode step runs on caches the weights just streamed through, ~10-30 us
    apiece, so the general path's bookkeeping cost more than its passes over the row (measured: 2x as long on
    Qwen2.5's and Gemma 3's heads; docs/measured-choices.md#logit-refinement)."""
    values = logits[row].detach().numpy()
    best = float(values.max())
    if best != best or best == float("-inf"):  # nothing allowed (all -inf): no candidates
        columns = np.empty(0, dtype=np.int64)
    else:
        columns = np.flatnonzero(values >= best - abs(best) * REFINE_RELATIVE_MARGIN)
    crowded = set()
    if len(columns) > 1 + REFINE_MAX_PER_ROW:  # a flat distribution: its best few only
        crowded = {row}
        columns = np.sort(columns[np.argsort(-values[columns], kind="stable")[: 1 + REFINE_MAX_PER_ROW]])
    picked = torch.from_numpy(columns)
    return torch.full((len(columns),), row, dtype=torch.long), picked, crowded


# Several rows search their logits a chunk at a time: each chunk's maximum first (torch's reduction, on every
# thread), then the compare only over the chunks that reach a row's floor (measured against one compare over
# every row: docs/measured-choices.md#logit-refinement).
SEARCH_CHUNK = 1024


def _near_top_of_many(
    logits: torch.Tensor, rows: list[int], depths: list[int] | None
) -> tuple[torch.Tensor, torch.Tensor, set[int]]:
    index = torch.tensor(rows, dtype=torch.long)
    picked = logits if rows == list(range(logits.shape[0])) else logits[index]
    values = picked.detach().numpy()
    count, width = values.shape
    body = width - width % SEARCH_CHUNK
    chunks = body // SEARCH_CHUNK
    peaks = picked[:, :body].reshape(count, chunks, SEARCH_CHUNK).amax(dim=2).numpy()
    edge = peaks.max(axis=1) if chunks else np.full(count, -np.inf, dtype=values.dtype)
    tail = values[:, body:]
    if body < width:
        edge = np.maximum(edge, tail.max(axis=1))
    wanted = np.clip(np.asarray(depths or [1] * count), 1, width)
    deep = np.flatnonzero(wanted > 1)
    if len(deep):  # rows that report alternatives: the n-th best bounds them (rare, so torch's topk there)
        ranked = picked[torch.from_numpy(deep)].topk(int(wanted.max()), dim=-1).values.numpy()
        edge[deep] = ranked[np.arange(len(deep)), wanted[deep] - 1]
    with np.errstate(invalid="ignore"):  # a row with nothing allowed (all -inf) gets an inf floor: no candidates
        floor = np.where(np.isfinite(edge), edge - np.abs(edge) * REFINE_RELATIVE_MARGIN, np.inf)
    hit_rows, hit_chunks = np.nonzero(peaks >= floor[:, None])
    blocks = values[:, :body].reshape(count, chunks, SEARCH_CHUNK)[hit_rows, hit_chunks]
    within, offset = np.nonzero(blocks >= floor[hit_rows][:, None])
    local_rows, columns = hit_rows[within], hit_chunks[within] * SEARCH_CHUNK + offset
    if body < width:  # the columns past the last whole chunk, then back into (row, column) order
        tail_rows, tail_columns = np.nonzero(tail >= floor[:, None])
        local_rows = np.concatenate([local_rows, tail_rows])
        columns = np.concatenate([columns, body + tail_columns])
        order = np.argsort(local_rows * width + columns, kind="stable")
        local_rows, columns = local_rows[order], columns[order]
    counts = np.bincount(local_rows, minlength=count)
    limit = wanted + REFINE_MAX_PER_ROW
    crowded = np.flatnonzero(counts > limit)
    if len(crowded):  # a flat distribution: keep each such row's best `limit` only
        keep = np.ones(len(columns), dtype=bool)
        for row in crowded:
            mine = np.flatnonzero(local_rows == row)
            order = np.argsort(-values[row, columns[mine]], kind="stable")
            keep[mine[order[limit[row] :]]] = False
        local_rows, columns = local_rows[keep], columns[keep]
    picked_columns = torch.from_numpy(columns.astype(np.int64))
    return index[torch.from_numpy(local_rows)], picked_columns, {rows[int(r)] for r in crowded}


class RoundingHead(Protocol):
    """A head whose outputs may come back rounded, and which can compute single outputs exactly."""

    @property
    def rounds_outputs(self) -> bool: ...

    def select(self, x: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor: ...


# {row: columns, ascending}: where a row's best logit lies, every one of them exact (see `refine_near_top`).
BestAmong = dict[int, torch.Tensor]


def refine_near_top(
    head: RoundingHead, logits: torch.Tensor, hidden: torch.Tensor, rows: list[int], depths: list[int] | None = None
) -> BestAmong:
    """Recompute in place, exactly, the given rows' logits within rounding distance of each row's best (or
    `depths[i]`-th best, see `near_top`); `hidden` [B, in_features] is what gave `logits` [B, vocab]. Nothing
    where the head does not round.

    Returns, per row whose candidates were all recomputed (not a crowded one), those columns: the row's best
    logit is among them (the margin is what bounds the rounding), so a greedy pick over them is the pick over the
    whole row: a full row's argmax (~0.35 ms over Gemma 3's 262,144 logits on an AMD EPYC, every step) need not
    run. Valid until the logits change."""
    if not head.rounds_outputs or not rows:
        return {}
    index, columns, crowded = _near_top(logits, rows, depths)
    among: BestAmong = {}
    if len(columns):
        logits[index, columns] = head.select(hidden, index, columns).float()
        if len(rows) == 1:  # a single stream's step: its columns, without splitting them by row
            return {} if crowded else {rows[0]: columns}
        # Each row's candidates lie together, ascending (near_top's order).
        owners, counts = torch.unique_consecutive(index, return_counts=True)
        for row, part in zip(owners.tolist(), torch.split(columns, counts.tolist()), strict=True):
            if row not in crowded:
                among[row] = part
    return among
