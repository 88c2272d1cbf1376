"""A slot-based KV cache: one preallocated row per running sequence, written at each row's own position.

transformers' attention layers call `cache.update(k, v, layer_idx)` and attend over what it returns;
rows of different lengths share one batched forward because the caller passes an explicit 4-D mask.
Rolling a sequence back (revision) is just lowering its length: stale positions are masked, then
overwritten.
"""

from __future__ import annotations

from typing import Any

import torch


class SlotKVCache:
    def __init__(
        self,
        *,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_slots, num_kv_heads, max_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = max_len
        self.num_slots = num_slots
        self._slots: torch.Tensor | None = None
        self._starts: torch.Tensor | None = None
        self._span = 0
        self._q_len = 1
        self._rows: list[tuple[int, int]] = []

    def bind(self, slots: list[int], starts: list[int], q_len: int, device: torch.device) -> int:
        """Say which rows the next forward writes: row i goes to slot `slots[i]` from `starts[i]`.
        Returns the key length the attention will see."""
        self._slots = torch.tensor(slots, device=device)
        self._starts = torch.tensor(starts, device=device)
        # Host copies for the per-row writes of multi-token rows: reading the device tensors there would
        # synchronise with the GPU once per row and layer.
        self._rows = list(zip(slots, starts, strict=True))
        self._q_len = q_len
        self._span = max(starts) + q_len
        self._contiguous = slots == list(range(slots[0], slots[0] + len(slots)))
        self._first = slots[0]
        self._n = len(slots)
        return self._span

    # The transformers Cache API surface the decoder layers use.
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self._slots is not None and self._starts is not None, "bind() before forward"
        k_buf, v_buf = self.keys[layer_idx], self.values[layer_idx]
        if self._q_len == 1:
            k_buf[self._slots, :, self._starts] = key_states[:, :, 0].to(k_buf.dtype)
            v_buf[self._slots, :, self._starts] = value_states[:, :, 0].to(v_buf.dtype)
        else:
            for row, (slot, start) in enumerate(self._rows):
                k_buf[slot, :, start : start + self._q_len] = key_states[row].to(k_buf.dtype)
                v_buf[slot, :, start : start + self._q_len] = value_states[row].to(v_buf.dtype)
        if self._contiguous:  # a view, no copy
            end = self._first + self._n
            return k_buf[self._first : end, :, : self._span], v_buf[self._first : end, :, : self._span]
        return k_buf[self._slots, :, : self._span], v_buf[self._slots, :, : self._span]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._span

    def copy_positions(self, src: int, dst: int, start: int, end: int) -> None:
        """Copy the KV of positions [start, end) from slot `src` to slot `dst` (a prefix-cache hit)."""
        for buf in (*self.keys, *self.values):
            buf[dst, :, start:end] = buf[src, :, start:end]

    def read_positions(self, slot: int, start: int, end: int) -> torch.Tensor:
        """A host copy of the KV of positions [start, end) of `slot`: every layer's keys then values, stacked."""
        return torch.stack([buf[slot, :, start:end] for buf in (*self.keys, *self.values)]).to("cpu")

    def write_positions(self, slot: int, start: int, block: torch.Tensor, count: int | None = None) -> None:
        """Write a `read_positions` copy back (its first `count` positions, or all), into `slot` from `start`."""
        for buf, whole in zip((*self.keys, *self.values), block, strict=True):
            part = whole if count is None else whole[:, :count]
            buf[slot, :, start : start + part.shape[1]] = part
