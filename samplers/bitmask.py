"""Applying a token bitmask (allocate_bitmask's layout) to logits: -inf where the grammar forbids a token.

xgrammar's CPU kernel visits every forbidden token, so its cost grows with how much a mask forbids: 0.5 ms
for one row of the 128,257-token vocabulary that allows a handful of tokens (the usual case inside a JSON
structure), 4 ms for a batch of 8 such rows, 12 % of the engine thread in a constrained run at concurrency 8
(py-spy). A row that allows few tokens is cheaper the other way round: unpack only its non-zero words,
save those logits, fill the row with -inf and put them back (~0.05 ms). Rows that allow much (free text
inside a string) stay on xgrammar's kernel, which is fastest there; on CUDA everything does.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

# A row is "sparse" when fewer than 1 in this many of its 32-bit words has any bit set.
_SPARSE_WORD_RATIO = 4
_BIT = np.arange(32, dtype=np.uint32)


def allowed_ids(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """Token ids whose bit is set in one row's int32 words (int64, ascending, below vocab_size)."""
    nonzero = np.flatnonzero(words)
    bits = (words[nonzero].view(np.uint32)[:, None] >> _BIT) & 1
    ids = (nonzero[:, None] * 32 + _BIT.astype(np.int64))[bits.astype(bool)]
    below: np.ndarray = ids[ids < vocab_size]
    return below


def allowed_counts(bitmask: torch.Tensor, rows: Sequence[int]) -> list[int]:
    """How many bits each of `rows` has set (one vectorised popcount over all of them)."""
    if not rows:
        return []
    words = bitmask.numpy()[list(rows)].view(np.uint32)
    counts: list[int] = np.bitwise_count(words).sum(axis=1, dtype=np.int64).tolist()
    return counts


def unpack_rows(
    bitmask: torch.Tensor, rows: Sequence[int], vocab_size: int, max_ids: int
) -> tuple[dict[int, int], dict[int, np.ndarray]]:
    """Each of `rows`' count of set bits, and the allowed ids of those that allow at most `max_ids` tokens.
    The count comes first: unpacking a row that allows most of the vocabulary costs ~1 ms."""
    counts = dict(zip(rows, allowed_counts(bitmask, rows), strict=True))
    words = bitmask.numpy()
    found: dict[int, np.ndarray] = {}
    for row in rows:
        if counts[row] <= max_ids:
            ids = allowed_ids(words[row], vocab_size)
            if len(ids) <= max_ids:  # bits past the vocabulary were counted above
                found[row] = ids
    return counts, found


def sparse_limit(vocab_size: int) -> int:
    """Most allowed tokens a row may have to count as sparse (its head and mask are then done per id)."""
    return vocab_size // 16


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | None = None) -> None:
    """Set disallowed logits to -inf in place, for `rows` of logits (row i uses bitmask row i; default all).
    Tokens past the bitmask's width (32 × words) are left alone, as xgrammar's kernels do."""
    import xgrammar

    targets = list(range(logits.shape[0])) if rows is None else list(rows)
    if logits.device.type != "cpu":
        mask = bitmask.to(logits.device, non_blocking=True)
        xgrammar.apply_token_bitmask_inplace(logits, mask, indices=targets)
        return
    vocab = min(logits.shape[-1], bitmask.shape[-1] * 32)
    words = bitmask.numpy()
    wide: list[int] = []
    for row in targets:
        row_words = words[row]
        if np.count_nonzero(row_words) * _SPARSE_WORD_RATIO >= row_words.shape[0]:
            wide.append(row)
            continue
        ids = torch.from_numpy(allowed_ids(row_words, vocab))
        line = logits[row, :vocab]
        kept = line.index_select(0, ids)
        line.fill_(float("-inf"))
        line.index_copy_(0, ids, kept)
    if wide:
        xgrammar.apply_token_bitmask_inplace(logits, bitmask, indices=wide)
