"""Applying a token bitmask (allocate_bitmask's layout) to logits: -inf where the grammar forbids a token.

xgrammar's CPU kernel visits every forbidden token one bit at a time, so its cost grows with how much a mask
forbids. Each row goes the cheapest of three ways, chosen from its words (measured:
docs/measured-choices.md#bitmasks):
- few allowed (the usual case inside a JSON structure): unpack only its non-zero words, save those logits,
  fill the row with -inf and put them back (a tenth of xgrammar's time on a 128k vocabulary);
- nearly all allowed (free text inside a string): xgrammar's kernel, which skips whole allowed words;
- in between (a regex's `[a-z ]`, a CSV cell): unpack every bit with numpy and set the logits with
  branch-free integer operations, several times faster than xgrammar's kernel at half or a third allowed.
On CUDA everything goes to xgrammar's kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

# A row is "sparse" when fewer than 1 in this many of its 32-bit words has any bit set.
_SPARSE_WORD_RATIO = 4
# A row stays on xgrammar's kernel when at least this share of its words allows all 32 tokens: the kernel beat
# unpacking with 90 % of the words full and was far slower at half (measured: docs/measured-choices.md#bitmasks).
_FULL_WORD_SHARE = 0.8
# The integer type whose bits a logit's dtype is viewed as, to set -inf without a branch per token.
_SAME_WIDTH_INT = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
}
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
    The count comes first, as unpacking a row that allows most of the vocabulary is costly (measured:
    docs/measured-choices.md#bitmasks)."""
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
    full: list[int] = []
    for row in targets:
        row_words = words[row]
        width = row_words.shape[0]
        if np.count_nonzero(row_words) * _SPARSE_WORD_RATIO < width:
            _keep_only(logits[row, :vocab], allowed_ids(row_words, vocab))
        elif np.count_nonzero(row_words == -1) >= _FULL_WORD_SHARE * width:
            full.append(row)
        else:
            _select_unpacked(logits[row, :vocab], row_words)
    if full:
        xgrammar.apply_token_bitmask_inplace(logits, bitmask, indices=full)


def _keep_only(line: torch.Tensor, ids: np.ndarray) -> None:
    """-inf everywhere in `line` but at `ids`."""
    index = torch.from_numpy(ids)
    kept = line.index_select(0, index)
    line.fill_(float("-inf"))
    line.index_copy_(0, index, kept)


def _select_unpacked(line: torch.Tensor, row_words: np.ndarray) -> None:
    """-inf in `line` wherever the row's bit is clear: every bit unpacked (little-endian within each word, as
    the layout stores token 32·w + b at bit b of word w), then the logits' own bits kept or replaced by -inf's
    with integer and/or. Branch-free: torch.where on the unpacked bits was several times slower on scattered
    masks than on blocky ones (mispredicted branches); this costs about the same for either (measured:
    docs/measured-choices.md#bitmasks)."""
    as_int = _SAME_WIDTH_INT[line.dtype]
    bits = np.unpackbits(row_words.view(np.uint8), bitorder="little")[: line.shape[0]]
    keep = torch.from_numpy(bits).to(as_int).neg_()  # all ones where allowed, zero where not
    neg_inf = int(torch.tensor(float("-inf"), dtype=line.dtype).view(as_int))
    words = line.view(as_int)
    words.bitwise_and_(keep).bitwise_or_(keep.bitwise_not_().bitwise_and_(neg_inf))
