"""The seam between a KV cache and ggml's one-graph decoder (corral/kernels/ggml_layers.py): how the cache holds
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
    token_index: torch.Tensor | None = None  # [T] the tokens' places in the step's pack (long rows may be between)


class LongRow(NamedTuple):
    """A row feeding more tokens than a decode layout takes (a prompt or a chunk of one): its tokens lie at
    [offset, offset + tokens) of the pack and go to `slot` from position `start`."""

    offset: int
    tokens: int
    slot: int
    start: int


class StepRows(NamedTuple):
    """Every row of the bound step: the short ones as one decode layout (None if there are none), and each
    long one on its own."""

    short: DecodeLayout | None
    long: tuple[LongRow, ...]
    write_index: torch.Tensor | None = None  # [T] each packed token's flat slot * max_len + position, if known


class DecodeCache(Protocol):
    """A KV cache whose layout the one-graph decoder reads and writes in place: per layer, keys and values
    [slots, max_len, kv_heads, head_dim] (float32; float16 too for the graphs of any step); flat index
    slot * max_len + position."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    max_len: int

    def decode_layout(self) -> DecodeLayout | None:
        """The bound step's layout when every row feeds few tokens, else None (a prompt: the per-layer path)."""
        ...

    def step_rows(self) -> StepRows:
        """The bound step's rows, short and long (corral/kernels/ggml_step_graph.py takes any step)."""
        ...
