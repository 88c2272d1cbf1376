"""The KV cache of corral's own decoder: one region per slot, attended where it lies (never gathered).

Layout per layer: [slots, max_len, kv_heads, head_dim]. A step's new keys and values land with one
`index_copy_` per layer (flat index slot * max_len + position). Attention then reads each row's keys in
place, as a strided view of its slot:

- rows feeding at most SHORT_ROW_MAX tokens (a decode token, a token plus its grammar-forced continuation,
  a re-fed token after a revision) share one SDPA call over the view of the slot range they occupy, each
  query with its own causal length; query heads of a GQA group are folded into the query axis, so no key
  is repeated; a shorter row's missing queries are padding whose output is dropped;
- longer rows (prompts) attend one by one with their own causal mask: a prompt is never padded to
  another's length, nor another row to a prompt's.

A plain decode step (one token per row, rows in consecutive slots in pack order) skips the query block: the
pack is already in its layout, and a single row that sees all its keys needs no mask.

Rolling a row back is lowering its length; positions past it are masked and later overwritten.

Layers with a sliding window (Gemma 3, Mistral) keep every position too: a query at position p sees keys in
(p - window, p], so a step whose keys reach past the window gets a second mask for those layers. Keeping the
whole row keeps rollbacks and prefix-cache copies the same for every layer.
"""

from __future__ import annotations

import functools
import math
import mmap
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from corral.kernels.decode_layout import DecodeLayout, LongRow, StepRows


@dataclass(frozen=True)
class _MultiRow:
    offset: int  # first index of the row's tokens in the step's pack
    count: int
    slot: int
    length: int  # keys the row's last token sees (start + count)
    mask: torch.Tensor | None  # [count, length] causal mask; None: the row starts at 0 (plain causal)
    window_mask: torch.Tensor | None  # the mask of sliding-window layers; None: the same as `mask`


# Rows feeding up to this many tokens share the batched call. Forced continuations are mostly 2-8 tokens;
# a prompt padded into the batch would make every other row's query block as long as it.
SHORT_ROW_MAX = 16


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros that take memory only where written, on CPU: an anonymous mapping, whose pages the kernel commits
    on first write. A cache sized for every slot's whole context then costs what the rows actually hold (a
    16-slot, 4,096-token cache of Qwen2.5 1.5B is 1.8 GB in float16; a few requests touch tens of MB)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    region = mmap.mmap(-1, max(1, count * torch.empty(0, dtype=dtype).element_size()))
    return torch.frombuffer(region, dtype=dtype, count=count).view(shape)  # the tensor keeps the mapping alive


_CPU = torch.device("cpu")


@dataclass(frozen=True)
class StepPlan:
    """Everything about a step's layout that every layer shares, computed once per step."""

    write_index: torch.Tensor  # [T] flat slot * max_len + position
    decode_tokens: torch.Tensor | None  # [D] pack indices of the short rows' tokens
    decode_slots: torch.Tensor | None  # [D] their slots, relative to `slot_lo`
    decode_query: torch.Tensor | None  # [D] each token's index within its row (its query block row)
    slot_lo: int
    slot_count: int
    span: int  # longest key length among short rows
    queries: int  # longest short row (the query block's length)
    multi: tuple[_MultiRow, ...]
    # Every row feeds one token and the rows are consecutive slots in pack order: the pack itself is the query
    # block (no zero-filled block, scatter or gather; measured: docs/changelog.md#2026-11-26-second).
    direct: bool = False
    # What the short rows' masks are made from, once a layer reads them: the keys each query sees [slot_count,
    # queries], the GQA group, the sliding window, the device. ggml's graphs attend from the layout alone and
    # never read the masks, so they are not built for them (numpy work on cold caches every step).
    seen: np.ndarray | None = None
    group: int = 1
    window: int | None = None
    device: torch.device = _CPU
    positions: torch.Tensor | None = None  # [T] each packed token's position in its slot

    @functools.cached_property
    def decode_mask(self) -> torch.Tensor | None:
        """[slot_count, 1, queries * group, span]; None where one row sees all its keys."""
        if self.seen is None or (self.direct and self.slot_count == 1):
            return None
        return self._mask(self._visible())

    @functools.cached_property
    def decode_window_mask(self) -> torch.Tensor | None:
        """The mask of sliding-window layers (keys past the window hidden); None as `decode_mask`."""
        if self.seen is None:
            return None
        if self.window is None or self.span <= self.window:
            return self.decode_mask
        # A query at position p = seen - 1 sees keys in (p - window, p]; padding (seen 1) keeps key 0.
        return self._mask(self._visible() & (np.arange(self.span) >= self.seen[:, :, None] - self.window))

    def _visible(self) -> np.ndarray:
        assert self.seen is not None
        return np.arange(self.span) < self.seen[:, :, None]  # [slots, Q, span]

    def _mask(self, visible: np.ndarray) -> torch.Tensor:
        # GQA: the query axis is Q × group (each query's group heads in a row): repeat each query's line.
        expanded = np.ascontiguousarray(np.repeat(visible, self.group, axis=1)[:, None])
        return torch.from_numpy(expanded).to(self.device)


class InPlaceKVCache:
    def __init__(
        self,
        *,
        num_layers: int,
        num_slots: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        layer_windows: Sequence[int | None] | None = None,
        scale: float | None = None,
    ) -> None:
        """layer_windows: each layer's sliding window (None: full attention); one window size at most.
        scale: the attention's query scale (None: 1 / sqrt(head_dim))."""
        windows = list(layer_windows) if layer_windows is not None else [None] * num_layers
        sizes = {w for w in windows if w is not None}
        if len(windows) != num_layers or len(sizes) > 1:
            raise ValueError("layer_windows must name one window size (or None) for each layer")
        self.window = sizes.pop() if sizes else None
        self._windowed = [w is not None for w in windows]
        self.scale = scale
        shape = (num_slots, max_len, num_kv_heads, head_dim)
        self.keys = [_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.values = [_zeros(shape, dtype, device) for _ in range(num_layers)]
        # Where the buffers lie (they never move): step graphs that point at them check these once a step.
        self.buffer_pointers = tuple(t.data_ptr() for t in (*self.keys, *self.values))
        self.num_slots = num_slots
        self.max_len = max_len
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.device = device
        self._positions = torch.arange(max_len, device=device)
        self._plan: StepPlan | None = None

    def plan(self, slots: Sequence[int], starts: Sequence[int], counts: Sequence[int]) -> StepPlan:
        """Lay out a step whose rows feed `counts[i]` tokens to slot `slots[i]` from position `starts[i]`,
        packed in row order. Binds the plan for the following forward and returns it."""
        one_each = len(counts) > 0 and all(count == 1 for count in counts)
        self._plan = self._plan_one_each(slots, starts) if one_each else self._plan_any(slots, starts, counts)
        return self._plan

    def _plan_any(self, slots: Sequence[int], starts: Sequence[int], counts: Sequence[int]) -> StepPlan:
        # Index arithmetic in numpy over the whole pack: per-token Python lists and many small tensors cost up to
        # a third of a decode step of the default model (measured: docs/measured-choices.md#slot-attention).
        slot_arr = np.asarray(slots, dtype=np.int64)
        start_arr = np.asarray(starts, dtype=np.int64)
        count_arr = np.asarray(counts, dtype=np.int64)
        offsets = np.cumsum(count_arr) - count_arr
        row_of = np.repeat(np.arange(len(count_arr)), count_arr)  # each packed token's row
        within = np.arange(len(row_of)) - offsets[row_of]  # each token's index within its row
        positions = start_arr[row_of] + within
        write_index = self._tensor(slot_arr[row_of] * self.max_len + positions)
        window = self.window
        multi: list[_MultiRow] = []
        for i in np.flatnonzero(count_arr > SHORT_ROW_MAX).tolist():
            n, start = counts[i], starts[i]
            length = start + n
            mask = window_mask = None
            windowed = window is not None and length > window
            if start > 0 or windowed:
                keys, query_pos = self._positions[None, :length], start + self._positions[:n, None]
                causal = keys <= query_pos
                mask = causal if start > 0 else None
                if window is not None and windowed:
                    window_mask = causal & (keys > query_pos - window)
            multi.append(_MultiRow(int(offsets[i]), n, slots[i], length, mask, window_mask))
        decode_tokens = decode_slots = decode_query = seen = None
        slot_lo = slot_count = span = queries = 0
        direct = False
        short = count_arr <= SHORT_ROW_MAX
        if short.any():
            short_slots = slot_arr[short]
            slot_lo = int(short_slots.min())
            slot_count = int(short_slots.max()) - slot_lo + 1
            span = int((start_arr + count_arr)[short].max())
            queries = int(count_arr[short].max())
            tokens = np.flatnonzero(short[row_of])
            token_slots = slot_arr[row_of[tokens]] - slot_lo
            token_query = within[tokens]
            # Keys each query sees: its own position + 1. Padding queries (and slots without a row) see key 0
            # only, so their softmax stays finite; their outputs are never read.
            seen = np.ones((slot_count, queries), dtype=np.int64)
            seen[token_slots, token_query] = positions[tokens] + 1
            decode_tokens = self._tensor(tokens)
            decode_slots = self._tensor(token_slots)
            decode_query = self._tensor(token_query)
            direct = not multi and queries == 1 and np.array_equal(slot_arr - slot_lo, np.arange(len(slot_arr)))
        return StepPlan(
            write_index,
            decode_tokens,
            decode_slots,
            decode_query,
            slot_lo,
            slot_count,
            span,
            queries,
            tuple(multi),
            direct,
            seen,
            self.num_heads // self.num_kv_heads,
            window,
            self.device,
            self._tensor(positions),
        )

    def _plan_one_each(self, slots: Sequence[int], starts: Sequence[int]) -> StepPlan:
        """`plan` for the usual decode step, every row feeding one token: the same layout in a third of the numpy
        calls (each call right after a step runs on caches the weights just streamed through)."""
        slot_arr = np.asarray(slots, dtype=np.int64)
        start_arr = np.asarray(starts, dtype=np.int64)
        lo, hi = int(slot_arr.min()), int(slot_arr.max())
        token_slots = slot_arr - lo
        rows = len(slot_arr)
        seen = np.ones((hi - lo + 1, 1), dtype=np.int64)
        seen[token_slots, 0] = start_arr + 1
        direct = hi - lo + 1 == rows and bool((token_slots == np.arange(rows)).all())
        return StepPlan(
            self._tensor(slot_arr * self.max_len + start_arr),
            self._tensor(np.arange(rows)),
            self._tensor(token_slots),
            self._tensor(np.zeros(rows, dtype=np.int64)),
            lo,
            hi - lo + 1,
            int(start_arr.max()) + 1,
            1,
            (),
            direct,
            seen,
            self.num_heads // self.num_kv_heads,
            self.window,
            self.device,
            self._tensor(start_arr),
        )

    def decode_layout(self) -> DecodeLayout | None:
        """The bound step's layout when every row feeds at most SHORT_ROW_MAX tokens (a decode step, forced
        tokens and short prompts included; rows in any slots), else None. ggml's one-graph decoder
        (corral/kernels/ggml_layers.py) attends such a step over this cache's buffers itself."""
        plan = self._plan
        if plan is None or plan.multi or plan.decode_slots is None or plan.decode_query is None:
            return None
        return DecodeLayout(
            plan.slot_lo, plan.slot_count, plan.queries, plan.decode_slots, plan.decode_query, plan.direct,
            plan.decode_tokens,
        )

    def step_rows(self) -> StepRows:
        """The bound step's short rows as one layout (as `decode_layout` gives it when there are no long ones)
        and each long row (a prompt) with its place in the pack."""
        plan = self._plan
        assert plan is not None, "plan() before forward"
        short = None
        if plan.decode_slots is not None and plan.decode_query is not None and plan.decode_tokens is not None:
            short = DecodeLayout(plan.slot_lo, plan.slot_count, plan.queries, plan.decode_slots, plan.decode_query,
                                 plan.direct, plan.decode_tokens)
        long = tuple(LongRow(row.offset, row.count, row.slot, row.length - row.count) for row in plan.multi)
        return StepRows(short, long, plan.write_index)

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write this step's k, v [T, kv_heads, head_dim]; return attention of q [T, heads, head_dim]."""
        plan = self._plan
        assert plan is not None, "plan() before forward"
        k_buf, v_buf = self.keys[layer], self.values[layer]
        flat = (-1, self.num_kv_heads, self.head_dim)
        k_buf.view(flat).index_copy_(0, plan.write_index, k.to(k_buf.dtype))
        v_buf.view(flat).index_copy_(0, plan.write_index, v.to(v_buf.dtype))
        out = torch.empty_like(q)
        windowed = self._windowed[layer]
        if plan.decode_tokens is not None and plan.decode_slots is not None and plan.decode_query is not None:
            group = self.num_heads // self.num_kv_heads
            lo, hi = plan.slot_lo, plan.slot_lo + plan.slot_count
            # [slots, kv_heads, span, head_dim] views of the slots' regions: no copy.
            keys = k_buf[lo:hi, : plan.span].transpose(1, 2)
            values = v_buf[lo:hi, : plan.span].transpose(1, 2)
            mask = plan.decode_window_mask if windowed else plan.decode_mask
            if plan.direct:
                flat_query = q.reshape(plan.slot_count, self.num_kv_heads, group, self.head_dim)
                attn = F.scaled_dot_product_attention(flat_query, keys, values, attn_mask=mask, scale=self.scale)
                return attn.reshape(-1, self.num_heads, self.head_dim)
            # Query block per slot: [slots, kv_heads, queries, group, head_dim], flattened to queries * group.
            query = q.new_zeros(plan.slot_count, self.num_kv_heads, plan.queries, group, self.head_dim)
            picked = q.index_select(0, plan.decode_tokens).view(-1, self.num_kv_heads, group, self.head_dim)
            query[plan.decode_slots, :, plan.decode_query] = picked
            flat_query = query.view(plan.slot_count, self.num_kv_heads, plan.queries * group, self.head_dim)
            attn = F.scaled_dot_product_attention(flat_query, keys, values, attn_mask=mask, scale=self.scale)
            attn = attn.view(plan.slot_count, self.num_kv_heads, plan.queries, group, self.head_dim)
            out[plan.decode_tokens] = attn[plan.decode_slots, :, plan.decode_query].reshape(
                -1, self.num_heads, self.head_dim
            )
        for row in plan.multi:
            end = row.offset + row.count
            query = q[row.offset : end].transpose(0, 1)[None]
            keys = k_buf[row.slot, : row.length].transpose(0, 1)[None]
            values = v_buf[row.slot, : row.length].transpose(0, 1)[None]
            row_mask = row.window_mask if windowed and row.window_mask is not None else row.mask
            attn = F.scaled_dot_product_attention(
                query,
                keys,
                values,
                attn_mask=row_mask,
                is_causal=row_mask is None,
                enable_gqa=True,
                scale=self.scale,
            )
            out[row.offset : end] = attn[0].transpose(0, 1)
        return out

    def copy_positions(self, src: int, dst: int, start: int, end: int) -> None:
        """Copy the KV of positions [start, end) from slot `src` to slot `dst` (a prefix-cache hit)."""
        for buf in (*self.keys, *self.values):
            buf[dst, start:end] = buf[src, start:end]

    def read_positions(self, slot: int, start: int, end: int) -> torch.Tensor:
        """A host copy of the KV of positions [start, end) of `slot`: every layer's keys then values, stacked."""
        return torch.stack([buf[slot, start:end] for buf in (*self.keys, *self.values)]).to("cpu")

    def write_positions(self, slot: int, start: int, block: torch.Tensor, count: int | None = None) -> None:
        """Write a `read_positions` copy back (its first `count` positions, or all), into `slot` from `start`."""
        for buf, whole in zip((*self.keys, *self.values), block, strict=True):
            part = whole if count is None else whole[:count]
            buf[slot, start : start + part.shape[0]] = part
