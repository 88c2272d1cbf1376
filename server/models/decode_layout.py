"""The seam between a KV cache and ggml's one-graph decoder (server/models/ggml_layers.py): how the cache holds
keys and values, and where each token of the bound step goes."""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch


class DecodeLayout(NamedTuple):
    """A step whose rows each feed a few tokens (a decode token, the grammar's forced ones after it, a short
    prompt), in any slots of the range [first_slot, first_slot + slots)."""

    first_slot: int
    slots: int  # the range's width: rows, and the free slots between them
    queries: int  # the most tokens a row feeds
    token_slot: torch.Tensor  # [T] each packed token's slot, relative to first_slot
    token_query: torch.Tensor  # [T] its index within its row
    direct: bool  # one token a row, the rows in consecutive slots in pack order: the pack is the layout


class DecodeCache(Protocol):
    """A KV cache whose layout the one-graph decoder reads and writes in place: per layer, float32 keys and
    values [slots, max_len, kv_heads, head_dim]; flat index slot * max_len + position."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    max_len: int

    def decode_layout(self) -> DecodeLayout | None:
        """The bound step's layout when every row feeds few tokens, else None (a prompt: the per-layer path)."""
        ...
