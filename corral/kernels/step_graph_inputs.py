"""What a step graph's inputs hold (corral/kernels/ggml_step_graph.py), worked out from the step's layout: each
packed token's slot, where each token's attention output lies, and the attention masks of the short rows' block
and of each long row, as ggml's flash attention reads them (float16, 0 where a key is seen, -inf elsewhere)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from corral.kernels.decode_layout import DecodeLayout, LongRow

MASK_PAD = 32  # flash attention's masks cover the queries rounded up to this (GGML_KQ_MASK_PAD)
_SEEN, _HIDDEN = np.float16(0.0), np.float16(-np.inf)


def short_indices(tokens: int, short: DecodeLayout) -> torch.Tensor:
    """The short rows' tokens' places in the pack."""
    return short.token_index if short.token_index is not None else torch.arange(tokens)


def flat_slots(tokens: int, short: DecodeLayout | None, long_rows: Sequence[LongRow]) -> torch.Tensor:
    """Each packed token's slot."""
    slots = torch.empty(tokens, dtype=torch.long)
    if short is not None:
        slots[short_indices(tokens, short)] = short.first_slot + short.token_slot
    for row in long_rows:
        slots[row.offset : row.offset + row.tokens] = row.slot
    return slots


def attention_order(tokens: int, short: DecodeLayout | None, long_rows: Sequence[LongRow]) -> torch.Tensor:
    """For each packed token, its row in the concatenated attention outputs: the short tokens' (in pack order)
    first, then each long row's."""
    order = torch.empty(tokens, dtype=torch.int32)
    at = 0
    if short is not None:
        index = short_indices(tokens, short)
        order[index] = torch.arange(len(index), dtype=torch.int32)
        at = len(index)
    for row in long_rows:
        order[row.offset : row.offset + row.tokens] = torch.arange(at, at + row.tokens, dtype=torch.int32)
        at += row.tokens
    return order


class ShortBlock(NamedTuple):
    """The short rows' block: keys each query sees [slots, queries, 1]; for a gathered block, each query's token
    in the pack (a padding query: token 0's) and each token's query."""

    lengths: np.ndarray
    gather: torch.Tensor | None
    scatter: torch.Tensor | None


def short_block(tokens: int, positions: torch.Tensor, short: DecodeLayout, slots: int, queries: int) -> ShortBlock:
    """Keys a query sees: its own position + 1; padding sees key 0 only (a finite softmax, output unread)."""
    if short.direct:  # one token a slot, in slot order: the pack is the block
        return ShortBlock(positions.numpy().reshape(slots, queries, 1) + 1, None, None)
    index = short_indices(tokens, short)
    cell = short.token_slot * queries + short.token_query  # each short token's place in the block
    filled = torch.ones(slots * queries, dtype=torch.long)
    filled[cell] = positions[index] + 1
    picked = torch.zeros(slots * queries, dtype=torch.int32)
    picked[cell] = index.to(torch.int32)
    return ShortBlock(filled.numpy().reshape(slots, queries, 1), picked, cell)


def fill_short_masks(full: np.ndarray, windowed: np.ndarray | None, lengths: np.ndarray, window: int | None) -> None:
    """Write the block's masks [slots, queries, keys] in place. numpy, not torch: each call here runs on caches the
    weights just streamed through, where numpy's small calls cost a fraction of torch's."""
    key_index = np.arange(full.shape[-1])
    visible = key_index < lengths
    full[...] = np.where(visible, _SEEN, _HIDDEN)
    if windowed is not None and window is not None:
        windowed[...] = np.where(visible & (key_index >= lengths - window), _SEEN, _HIDDEN)


def long_mask_dims(row: LongRow) -> tuple[int, int]:
    """A long row's causal mask: [keys, queries rounded up to the kernel's padding]."""
    return row.start + row.tokens, -(-row.tokens // MASK_PAD) * MASK_PAD


def long_masks(row: LongRow, window: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A long row's causal mask [padded queries, keys], and its sliding-window layers' (None without a window)."""
    keys, padded = long_mask_dims(row)
    query_position = row.start + torch.arange(padded)[:, None]
    key_index = torch.arange(keys)[None, :]
    visible = key_index <= query_position
    visible[row.tokens :] = key_index == 0  # padding queries see key 0 only
    full = torch.where(visible, 0.0, float("-inf"))
    if window is None:
        return full, None
    in_window = visible & (key_index > query_position - window)
    in_window[row.tokens :] = visible[row.tokens :]
    return full, torch.where(in_window, 0.0, float("-inf"))
