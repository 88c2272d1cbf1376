"""Any step of the decoder as one ggml graph, from token ids to each row's final-normed hidden state.

The graphs of ggml_layers.py take steps of few tokens a row, every tensor with memory of its own (Gemma 3's
shapes: a few MB a graph). A GGUF served from its own blocks (corral/server/models/gguf_decoder.py) runs every step
here instead, prompts included, so no float copy of its weights is ever needed:

- the embedding is looked up in the file's blocks (`get_rows` decodes just the step's rows);
- the graph is described first and given memory by ggml's graph allocator, which reuses a node's memory once
  every reader of it has run: a 512-token prompt chunk of a 1.5B model needs tens of MB, not the GBs that
  memory of its own for every node would take;
- the short rows (a decode token, the grammar's forced ones after it) attend as the one-graph decoder does
  (one block of queries per slot of their range), and each long row (a prompt) attends on its own over its
  slot, its queries never padded to another row's length; outputs are put back in the pack's order.

Graphs of decode steps are kept per shape (the same shapes recur step after step); a graph with a long row is
built for its step and freed after it (building costs milliseconds, a prompt chunk's compute seconds).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from corral.kernels.decode_layout import DecodeCache, DecodeLayout, LongRow
from corral.kernels.ggml_graph_parts import GraphContext, GraphParams, LayerParts, StepShape, rope_factors
from corral.kernels.row_kernel import GraphPlan, cpu_buffer_type, ggml_modules
from corral.kernels.step_graph_inputs import (
    attention_order,
    fill_short_masks,
    flat_slots,
    long_mask_dims,
    long_masks,
    short_block,
)

_MIN_KEY_BUCKET = 64
_LAYER_NODES = 64
_LONG_ROW_NODES = 12  # per layer, each long row's views, mask and attention
GRAPHS_KEPT = 64  # decode-step graphs kept, one per shape, the least recently used dropped


@dataclass(frozen=True)
class Embedding:
    """The token embedding as ggml looks rows up in it: a weight tensor [hidden, vocab] and the factor the
    model scales looked-up rows by (Gemma: sqrt(hidden))."""

    ggml_weight: Any
    scale: float


class StepGraphs:
    """The decoder's graphs for steps of any size: `hidden` takes the step's token ids and returns each row's
    final-normed last hidden state [rows, hidden] (float32), over a cache whose layout it reads and writes."""

    def __init__(
        self,
        shape: StepShape,
        layers: Sequence[LayerParts],
        ropes: Sequence[tuple[torch.Tensor, float]],
        final_norm: torch.Tensor,
        embedding: Embedding,
        head: Any = None,
    ) -> None:
        """ropes: per RoPE table, its inverse frequencies [head_dim / 2] and cos/sin scale. head: the vocabulary
        projection's ggml weight [hidden, vocab], for steps that want every logit (`hidden_and_logits`)."""
        self.shape, self.layers, self.final_norm, self.embedding = shape, list(layers), final_norm, embedding
        self.head = head
        gains: list[torch.Tensor] = [final_norm]
        for part in self.layers:
            optional = [part.qkv_bias, part.qk_norm_gain, part.o_bias, part.attn_out_norm, part.gate_up_bias]
            optional += [part.down_bias, part.mlp_out_norm]
            gains += [part.input_norm, part.mlp_norm] + [t for t in optional if t is not None]
        factors = [rope_factors(inv_freq, shape.head_dim) for inv_freq, _ in ropes]
        self.params = GraphParams(list(dict.fromkeys(gains, None)) + [f for _, f in factors])
        self.ropes = [
            (base, self.params[table], float(scale)) for (base, table), (_, scale) in zip(factors, ropes, strict=True)
        ]
        self._graphs: dict[tuple[Any, ...], _StepGraph] = {}
        self._graphs_cache: tuple[int, ...] = ()
        self.decode_steps = 0  # steps served by a kept graph, and by one built for its step (tests, profiling)
        self.prompt_steps = 0

    def hidden(
        self, input_ids: torch.Tensor, positions: torch.Tensor, last: torch.Tensor, cache: DecodeCache
    ) -> torch.Tensor:
        return self._step(input_ids, positions, last, cache, False)[0]

    def hidden_and_logits(
        self, input_ids: torch.Tensor, positions: torch.Tensor, last: torch.Tensor, cache: DecodeCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`hidden`, and each row's logits over the whole vocabulary [rows, vocab] from the same graph: a step
        whose rows all want every logit (free text) runs no second graph for its head. Needs `head`."""
        if self.head is None:
            raise ValueError("these step graphs were built without the head's weight")
        hidden, logits = self._step(input_ids, positions, last, cache, True)
        assert logits is not None
        return hidden, logits

    def _step(
        self, input_ids: torch.Tensor, positions: torch.Tensor, last: torch.Tensor, cache: DecodeCache,
        with_head: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        rows = cache.step_rows()
        threads = max(1, torch.get_num_threads())
        key_dtype = cache.keys[0].dtype
        if key_dtype not in (torch.float32, torch.float16):
            raise ValueError(f"the step graphs read a float32 or float16 cache, not {key_dtype}")
        tokens, outputs = len(input_ids), len(last)
        short = rows.short
        if short is not None:
            keys = int(positions[short.token_index].max()) + 1 if short.token_index is not None else 1
            bucket = min(cache.max_len, max(_MIN_KEY_BUCKET, 1 << (keys - 1).bit_length()))
            short_shape: tuple[int, int, int, bool] | None = (short.slots, short.queries, bucket, not short.direct)
        else:
            short_shape = None
        if rows.long:
            self.prompt_steps += 1
            graph = _StepGraph(self, cache, tokens, outputs, short_shape, rows.long, with_head)
            try:
                return graph.run(input_ids, positions, last, short, threads, rows.write_index)
            finally:
                graph.free()
        self.decode_steps += 1
        graph = self._kept(cache, (tokens, outputs, short_shape, with_head))
        return graph.run(input_ids, positions, last, short, threads, rows.write_index)

    def _kept(self, cache: DecodeCache, key: tuple[Any, ...]) -> _StepGraph:
        """The graph for a step of this shape over this cache (graphs point at its buffers: another cache
        drops them), the most recently used GRAPHS_KEPT kept."""
        pointers = getattr(cache, "buffer_pointers", None) or tuple(t.data_ptr() for t in (*cache.keys, *cache.values))
        if pointers != self._graphs_cache:
            for graph in self._graphs.values():
                graph.free()
            self._graphs, self._graphs_cache = {}, pointers
        if key in self._graphs:
            graph = self._graphs.pop(key)
        else:
            tokens, outputs, short_shape, with_head = key
            graph = _StepGraph(self, cache, tokens, outputs, short_shape, (), with_head)
            if len(self._graphs) >= GRAPHS_KEPT:
                self._graphs.pop(next(iter(self._graphs))).free()
        self._graphs[key] = graph
        return graph

    def drop_kept(self) -> None:
        """Free the kept graphs: their products chose their weights when built (after `GgufFile.settle_wide_rows`
        the next ones may choose others)."""
        for graph in self._graphs.values():
            graph.free()
        self._graphs, self._graphs_cache = {}, ()

    def __del__(self) -> None:
        for graph in getattr(self, "_graphs", {}).values():
            graph.free()
        params = getattr(self, "params", None)
        if params is not None:
            params.free()


class _StepGraph:
    """One step's graph: `tokens` tokens packed in row order, `outputs` rows' last hidden states out. The short
    rows (if any) attend as one block over `short_shape` = (slots of their range, queries a slot, keys,
    gathered); each long row over its own slot."""

    def __init__(
        self,
        steps: StepGraphs,
        cache: DecodeCache,
        tokens: int,
        outputs: int,
        short_shape: tuple[int, int, int, bool] | None,
        long_rows: Sequence[LongRow],
        with_head: bool = False,
    ) -> None:
        """with_head: the step's logits too, the head's product after the final norm (steps.head)."""
        ggml, _ = ggml_modules()
        self.ggml = ggml
        s, layers = steps.shape, steps.layers
        self.tokens, self.outputs, self.short_shape, self.long_rows = tokens, outputs, short_shape, tuple(long_rows)
        nodes = (_LAYER_NODES + _LONG_ROW_NODES * len(self.long_rows)) * len(layers) + 64
        size = (nodes + 32) * int(ggml.ggml_tensor_overhead()) + int(ggml.ggml_graph_overhead_custom(nodes, False))
        self.context = c = GraphContext(steps, tokens, size, allocate=False)
        self._inputs: list[Any] = [c.positions]
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        half = cache.keys[0].dtype == torch.float16
        kv_type, self._elt = (ggml.GGML_TYPE_F16, 2) if half else (ggml.GGML_TYPE_F32, 4)
        self._max_len = cache.max_len
        slot_bytes = cache.max_len * kv_size * self._elt
        self._slot_bytes = slot_bytes

        ids = self._input(ggml.GGML_TYPE_I32, tokens)
        write = self._input(ggml.GGML_TYPE_I64, tokens)
        last = self._input(ggml.GGML_TYPE_I32, outputs)
        x = ggml.ggml_get_rows(c.ctx, steps.embedding.ggml_weight, ids)
        if steps.embedding.scale != 1.0:
            x = ggml.ggml_scale(c.ctx, x, steps.embedding.scale)
        self._ids, self._write, self._last = ids, write, last

        # The short rows' block: masks [keys, queries, 1, slots]; gathered queries and their way back.
        self._full_mask = self._window_mask = self._gather = self._scatter = None
        if short_shape is not None:
            slots, queries, keys, gathered = short_shape
            self._full_mask = self._input(ggml.GGML_TYPE_F16, keys, queries, 1, slots)
            self._window_mask = self._input(ggml.GGML_TYPE_F16, keys, queries, 1, slots)
            if gathered:
                self._gather = self._input(ggml.GGML_TYPE_I32, slots * queries)
                self._scatter = self._input(ggml.GGML_TYPE_I32, self._short_tokens(tokens))
        # Each long row: its causal masks [keys, queries rounded up] (full and windowed).
        self._long_masks: list[tuple[Any, Any]] = [
            (self._input(ggml.GGML_TYPE_F16, *dims), self._input(ggml.GGML_TYPE_F16, *dims))
            for dims in map(long_mask_dims, self.long_rows)
        ]
        # Attention outputs back into the pack's order when long rows are in the step.
        self._order = self._input(ggml.GGML_TYPE_I32, tokens) if self.long_rows else None

        external = ggml.ggml_init_params(
            mem_size=2 * len(layers) * int(ggml.ggml_tensor_overhead()) + 4096, mem_buffer=None, no_alloc=True
        )
        self._cache_ctx: Any = ggml.ggml_init(external)
        self._short_views: list[Any] = []  # their data pointers move to the step's first slot
        self._views_offset: int | None = None  # where they point now (bytes past each buffer's start)
        self._cache_pointers: list[int] = []
        self._window = next((p.window for p in layers if p.window is not None), None)
        for i, layer in enumerate(layers):
            qkv, rotated = c.queries_keys_values(layer, x)
            per_token = rotated.contents.nb[2]
            new_k = ggml.ggml_view_2d(c.ctx, rotated, kv_size, tokens, per_token, s.num_heads * s.head_dim * 4)
            new_v = ggml.ggml_view_2d(c.ctx, qkv, kv_size, tokens, qkv.contents.nb[1], (q_size + kv_size) * 4)
            written = []
            for buffer, new in ((cache.keys[i], new_k), (cache.values[i], new_v)):
                whole = ggml.ggml_new_tensor_2d(self._cache_ctx, kv_type, kv_size, buffer.numel() // kv_size)
                whole.contents.data = buffer.data_ptr()
                self._cache_pointers.append(buffer.data_ptr())
                written.append(ggml.ggml_set_rows(c.ctx, whole, new, write))
            parts = []
            windowed = layer.window is not None
            if short_shape is not None:
                parts.append(self._short_attention(c, rotated, written, short_shape, windowed))
            for row, masks in zip(self.long_rows, self._long_masks, strict=True):
                parts.append(self._long_attention(c, rotated, written, row, masks[1] if windowed else masks[0]))
            attention = functools.reduce(lambda joined, more: ggml.ggml_concat(c.ctx, joined, more, 1), parts)
            if self._order is not None:
                attention = ggml.ggml_get_rows(c.ctx, attention, self._order)
            # The last layer's o projection and MLP only for the tokens whose hidden state is wanted (a prompt's
            # last): the rest of a prompt needed this layer's keys and values alone.
            gather = last if i == len(layers) - 1 and outputs < tokens else None
            x = c.layer_tail(layer, x, attention, gather)
        x = c.norm(x if outputs < tokens else ggml.ggml_get_rows(c.ctx, x, last), steps.final_norm)
        ggml.ggml_set_output(x)  # kept whole when the head reads it too: refinement recomputes from it
        self._vocab = 0
        self._logits: Any = None
        end = x
        if with_head:
            end = ggml.ggml_mul_mat(c.ctx, steps.head, x)  # [vocab, outputs]
            ggml.ggml_set_output(end)
            self._logits, self._vocab = end.contents, int(end.contents.ne[0])
        self.graph = ggml.ggml_new_graph_custom(c.ctx, nodes, False)
        ggml.ggml_build_forward_expand(self.graph, end)
        self._allocator: Any = ggml.ggml_gallocr_new(cpu_buffer_type())
        if not ggml.ggml_gallocr_alloc_graph(self._allocator, self.graph):
            self.free()
            raise MemoryError(f"ggml could not allocate a {tokens}-token step's graph")
        self._hidden, self._hidden_size = x.contents, s.hidden_size
        self._plan = GraphPlan(self.graph)
        self._views: dict[int, torch.Tensor] = {}

    def _in(self, tensor: Any, *shape: int) -> torch.Tensor:
        """Torch's view of an input (made once: ggml placed it when the graph was allocated)."""
        key = ctypes.addressof(tensor.contents)
        made = self._views.get(key)
        if made is None or tuple(made.shape) != shape:
            made = self._views[key] = self.context.view(tensor, *shape)
        return made

    def _input(self, kind: int, *dims: int) -> Any:
        made = self.context.new(kind, *dims)
        self.ggml.ggml_set_input(made)
        self._inputs.append(made)
        return made

    def _short_tokens(self, tokens: int) -> int:
        return tokens - sum(row.tokens for row in self.long_rows)

    def _short_attention(
        self, c: GraphContext, rotated: Any, written: list[Any], shape: tuple[int, int, int, bool], windowed: bool
    ) -> Any:
        """The short rows' attention [q_size, their tokens], in their pack order."""
        g, s = self.ggml, c.shape
        slots, queries, keys, gathered = shape
        kv_size, q_size = s.num_kv_heads * s.head_dim, s.num_heads * s.head_dim
        seen = []
        for tensor in written:  # [head_dim, keys, kv_heads, slots] from the range's first slot (moved per step)
            view = g.ggml_view_4d(c.ctx, tensor, s.head_dim, keys, s.num_kv_heads, slots, kv_size * self._elt,
                                  s.head_dim * self._elt, self._slot_bytes, 0)
            self._short_views.append(view.contents)
            seen.append(view)
        per_token = rotated.contents.nb[2]
        if not gathered:  # one token a row, in slot order: the queries as they lie [head_dim, 1, heads, slots]
            block = g.ggml_view_4d(c.ctx, rotated, s.head_dim, 1, s.num_heads, slots, per_token, s.head_dim * 4,
                                   per_token, 0)
        else:
            packed = g.ggml_view_2d(c.ctx, rotated, q_size, self.tokens, per_token, 0)
            picked = g.ggml_get_rows(c.ctx, packed, self._gather)
            block = g.ggml_permute(c.ctx, g.ggml_reshape_4d(c.ctx, picked, s.head_dim, s.num_heads, queries, slots),
                                   0, 2, 1, 3)
        mask = self._window_mask if windowed else self._full_mask
        out = g.ggml_flash_attn_ext(c.ctx, block, seen[0], seen[1], mask, s.attn_scale, 0.0, 0.0)
        out = g.ggml_reshape_2d(c.ctx, out, q_size, slots * queries)
        return g.ggml_get_rows(c.ctx, out, self._scatter) if self._scatter is not None else out

    def _long_attention(self, c: GraphContext, rotated: Any, written: list[Any], row: LongRow, mask: Any) -> Any:
        """One long row's attention [q_size, its tokens] over its slot's keys up to its last token."""
        g, s = self.ggml, c.shape
        kv_size, q_size = s.num_kv_heads * s.head_dim, s.num_heads * s.head_dim
        keys = row.start + row.tokens
        seen = [
            g.ggml_view_4d(c.ctx, tensor, s.head_dim, keys, s.num_kv_heads, 1, kv_size * self._elt,
                           s.head_dim * self._elt, self._slot_bytes, row.slot * self._slot_bytes)
            for tensor in written
        ]
        nb = rotated.contents.nb
        queries = g.ggml_view_3d(c.ctx, rotated, s.head_dim, s.num_heads, row.tokens, nb[1], nb[2], row.offset * nb[2])
        block = g.ggml_permute(c.ctx, queries, 0, 2, 1, 3)  # [head_dim, count, heads, 1]
        out = g.ggml_flash_attn_ext(c.ctx, block, seen[0], seen[1], mask, s.attn_scale, 0.0, 0.0)
        return g.ggml_reshape_2d(c.ctx, out, q_size, row.tokens)

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, last: torch.Tensor, short: DecodeLayout | None,
        threads: int, write_index: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rows' final-normed hidden states [outputs, hidden], and their logits [outputs, vocab] where the
        graph has the head. write_index: each token's flat slot * max_len + position, where the cache knows it."""
        c = self.context
        view = self._in
        view(self._ids, self.tokens).copy_(input_ids)
        view(c.positions, self.tokens).copy_(positions)
        if write_index is None:
            write_index = flat_slots(self.tokens, short, self.long_rows) * self._max_len + positions
        view(self._write, self.tokens).copy_(write_index)
        view(self._last, self.outputs).copy_(last)
        if short is not None and self.short_shape is not None:
            self._fill_short(positions, short)
        for row, (full, windowed) in zip(self.long_rows, self._long_masks, strict=True):
            self._fill_long(row, full, windowed)
        if self._order is not None:
            view(self._order, self.tokens).copy_(attention_order(self.tokens, short, self.long_rows))
        # The outputs are written straight into tensors of the caller's (their nodes' data pointed at them, as
        # RowKernel's products are), not copied out of the graph's memory.
        hidden = torch.empty(self.outputs, self._hidden_size)
        self._hidden.data = hidden.data_ptr()
        logits = None
        if self._logits is not None:
            logits = torch.empty(self.outputs, self._vocab)
            self._logits.data = logits.data_ptr()
        self._plan.compute(threads)
        return hidden, logits

    def _fill_short(self, positions: torch.Tensor, short: DecodeLayout) -> None:
        assert self.short_shape is not None
        slots, queries, keys, gathered = self.short_shape
        view = self._in
        block = short_block(self.tokens, positions, short, slots, queries)
        if gathered and block.gather is not None and block.scatter is not None:
            view(self._gather, slots * queries).copy_(block.gather)
            view(self._scatter, len(block.scatter)).copy_(block.scatter)
        windowed = view(self._window_mask, slots, queries, keys).numpy() if self._window is not None else None
        fill_short_masks(view(self._full_mask, slots, queries, keys).numpy(), windowed, block.lengths, self._window)
        offset = short.first_slot * self._slot_bytes
        if offset != self._views_offset:  # the same first slot as the last step's (a stream): views in place
            for i, view_contents in enumerate(self._short_views):
                view_contents.data = self._cache_pointers[i] + offset
            self._views_offset = offset

    def _fill_long(self, row: LongRow, full: Any, windowed: Any) -> None:
        keys, padded = long_mask_dims(row)
        causal, in_window = long_masks(row, self._window)
        self._in(full, padded, keys).copy_(causal)
        if in_window is not None:
            self._in(windowed, padded, keys).copy_(in_window)

    def free(self) -> None:
        ggml = self.ggml
        allocator = getattr(self, "_allocator", None)
        if allocator:
            ggml.ggml_gallocr_free(allocator)
            self._allocator = None
        self.context.free()
        if self._cache_ctx:
            ggml.ggml_free(self._cache_ctx)
            self._cache_ctx = None

