"""Decode steps of few tokens as ggml graphs: the decoder's small arithmetic, and attention, off torch.

With its products on ggml (row_kernel.py), a one-row step of Gemma 3 270M still spent a fifth of its time
outside them: some 25 torch calls per layer (norms, the per-head q/k norm, RoPE, the gate, residual adds, views
and casts), each a few microseconds of dispatch for a few hundred numbers, and attention, most of it Python
around a short kernel (measured: docs/measured-choices.md#ggml-graphs). ggml runs the same arithmetic as nodes
of a graph, a node for a few hundred numbers costing about a microsecond. Two forms:

- **One graph for the whole decoder** when every row of the step feeds one token or a few (a sampled token and
  the grammar's forced ones after it, a short prompt), in whatever slots (`DecodeCache.decode_layout`).
  Attention is ggml's too: this step's keys and values are written into the torch-owned KV cache (`set_rows`,
  by flat index) and `flash_attn_ext` reads the step's range of slots in place, each query masked to its own
  position (and a sliding layer's window). The graph is built per step shape (tokens, the slot range's width,
  tokens per row, a key bucket: a power of two >= the longest row, and whether queries are gathered into the
  slots' blocks): only the views' data pointers move, per step, to the range's first slot.
- **One graph per layer boundary** for steps over a cache the decoder graph cannot read (not float32, or
  another layout): attention stays in torch between the graphs, each running from one layer's attention
  output to the next one's queries, keys and values.

The products multiply the same fp16 weights the row kernels hold (no second copy). Arithmetic matches the
torch path up to ggml's roundings: a product's input is rounded to fp16 (as in row_kernel.py), and ggml's GELU
reads a table indexed by the fp16-rounded gate (llama.cpp computes Gemma this way). RoPE uses the model's own
frequencies (as ggml frequency factors), so scaled variants need nothing of their own.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol, cast

import torch

from corral.kernels.decode_layout import DecodeCache, DecodeLayout
from corral.kernels.ggml_graph_parts import GraphContext, GraphParams, LayerParts, StepShape, rope_factors
from corral.kernels.row_kernel import GraphPlan, ggml_modules, llamafile_built

log = logging.getLogger(__name__)

_BOUNDARY_NODES = 64  # a boundary has ~20 nodes; ggml's default graph reserves 2048
_LAYER_NODES = 48  # a layer of the one-graph decoder: ~35
_MIN_KEY_BUCKET = 64
# One-graph decoders kept, one per step shape (tokens, slots, tokens per row, key bucket, gathered), each a few MB
# and milliseconds to build for Gemma 3 (docs/measured-choices.md#ggml-graphs): enough for a batch's shapes as
# rows join, leave and carry forced tokens.
DECODERS_KEPT = 64


class Attend(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


def _activation_bytes(steps: GgmlLayerSteps, tokens: int) -> int:
    """Room for one layer's nodes at `tokens` tokens: every node has its own memory (no reuse), ~12
    hidden-wide vectors, qkv three times and the MLP's gate/up and gated vectors. Generous on purpose: ggml
    aborts the process when a context runs out."""
    s = steps.shape
    qkv = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
    widest = max(sum(k.out_features for k in part.gate_up) for part in steps.layers)
    ggml, _ = ggml_modules()
    return tokens * 4 * (12 * s.hidden_size + 4 * qkv + 2 * widest) + 64 * int(ggml.ggml_tensor_overhead())


class _BoundaryGraphs:
    """Every layer boundary's graph for one number of tokens, attention between them in torch."""

    def __init__(self, steps: GgmlLayerSteps, tokens: int) -> None:
        ggml, _ = ggml_modules()
        per_boundary = _activation_bytes(steps, tokens) + ggml.ggml_graph_overhead_custom(_BOUNDARY_NODES, False)
        self.context = c = GraphContext(steps, tokens, 2 * per_boundary * (len(steps.layers) + 1) + (1 << 16))
        s = steps.shape
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        self.x_in: list[torch.Tensor] = []
        self.attn_in: list[torch.Tensor | None] = []
        self.x_out: list[torch.Tensor] = []
        self.qkv: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = []
        self.plans: list[GraphPlan] = []
        layers = steps.layers
        for i in range(len(layers) + 1):
            x = c.new(ggml.GGML_TYPE_F32, s.hidden_size, tokens)
            self.x_in.append(c.view(x, tokens, s.hidden_size))
            attn_in = None
            if i > 0:
                attention = c.new(ggml.GGML_TYPE_F32, q_size, tokens)
                attn_in = c.view(attention, tokens, q_size)
                x = c.layer_tail(layers[i - 1], x, attention)
            self.attn_in.append(attn_in)
            graph = ggml.ggml_new_graph_custom(c.ctx, _BOUNDARY_NODES, False)
            ggml.ggml_build_forward_expand(graph, x)
            self.x_out.append(c.view(x, tokens, s.hidden_size))
            if i < len(layers):
                qkv, rotated = c.queries_keys_values(layers[i], x)
                ggml.ggml_build_forward_expand(graph, rotated)
                qk = c.view(rotated, tokens, s.num_heads + s.num_kv_heads, s.head_dim)
                values = c.view(qkv, tokens, q_size + 2 * kv_size)[:, q_size + kv_size :]
                q, k = qk[:, : s.num_heads], qk[:, s.num_heads :]
                self.qkv.append((q, k, values.view(tokens, s.num_kv_heads, s.head_dim)))
            else:
                self.qkv.append(None)
            self.plans.append(GraphPlan(graph))

    def run(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend, threads: int) -> torch.Tensor:
        tokens = int(x.shape[0])
        self.context.positions_in.copy_(positions)
        self.x_in[0].copy_(x)
        last = len(self.plans) - 1
        for i, plan in enumerate(self.plans):
            plan.compute(threads)
            qkv = self.qkv[i]
            if qkv is None:
                break
            attn = attend(i, *qkv)
            attn_in = self.attn_in[i + 1]
            assert attn_in is not None
            attn_in.copy_(attn.reshape(tokens, -1))
            self.x_in[i + 1].copy_(self.x_out[i])
        return self.x_out[last].clone()


class _DecodeGraph:
    """The whole decoder as one graph for `tokens` tokens in a range of `rows` slots (each row at most `queries`
    tokens), attending over up to `keys` positions of each slot; ends with the final norm: [tokens, hidden].

    ggml's attention takes a block of `queries` queries per slot of the range: where the pack is that layout
    (`gathered` false: one token a row, the rows in consecutive slots in pack order) the rotated queries are the
    block as they lie; else each token's query is gathered into its slot's block (rows in any order, free slots
    between them, several tokens a row: a sampled token and the grammar's forced ones after it), the rest of
    the block padding (masked to key 0, its outputs never read), and the outputs gathered back into the packed
    order. The products and norms see only the real tokens."""

    def __init__(
        self, steps: GgmlLayerSteps, cache: DecodeCache, tokens: int, rows: int, queries: int, keys: int,
        gathered: bool,
    ) -> None:
        ggml, _ = ggml_modules()
        layers = steps.layers
        nodes = _LAYER_NODES * len(layers) + 16
        s = steps.shape
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        padded = rows * queries
        per_layer = _activation_bytes(steps, tokens) + (3 * q_size * padded * 4 if gathered else 0)
        size = (per_layer + 4 * ggml.ggml_tensor_overhead()) * len(layers) + 2 * keys * padded * 2
        size += 4 * padded * 4 + ggml.ggml_graph_overhead_custom(nodes, False)
        self.context = c = GraphContext(steps, tokens, 2 * size + (1 << 16))
        self.tokens, self.rows, self.queries, self.keys, self.gathered = tokens, rows, queries, keys, gathered
        slot_bytes = cache.max_len * kv_size * 4
        x = c.new(ggml.GGML_TYPE_F32, s.hidden_size, tokens)
        self.x_in = c.view(x, tokens, s.hidden_size)
        write = c.new(ggml.GGML_TYPE_I64, tokens)
        self.write_in = c.view(write, tokens)
        # Masks [keys, queries, 1, rows] (fp16, as flash_attn_ext takes them): 0 where a query sees a key, -inf
        # elsewhere.
        full_mask = ggml.ggml_new_tensor_4d(c.ctx, ggml.GGML_TYPE_F16, keys, queries, 1, rows)
        window_mask = ggml.ggml_new_tensor_4d(c.ctx, ggml.GGML_TYPE_F16, keys, queries, 1, rows)
        self.full_mask_in = c.view(full_mask, rows, queries, keys)
        self.window_mask_in = c.view(window_mask, rows, queries, keys)
        gather = scatter = None
        if gathered:  # each query block's token in the pack, and each token's place in the blocks
            gather, scatter = c.new(ggml.GGML_TYPE_I32, padded), c.new(ggml.GGML_TYPE_I32, tokens)
            self.gather_in, self.scatter_in = c.view(gather, padded), c.view(scatter, tokens)
        # The cache's buffers, as ggml tensors over torch's memory [kv_size, slots * max_len].
        cache_bytes = 2 * len(layers) * ggml.ggml_tensor_overhead() + 4096
        external = ggml.ggml_init_params(mem_size=cache_bytes, mem_buffer=None, no_alloc=True)
        self._cache_ctx: Any = ggml.ggml_init(external)
        self._attention_views: list[Any] = []  # their data pointers move to the step's first slot
        self.cache_pointers: list[int] = []
        for i, layer in enumerate(layers):
            qkv, rotated = c.queries_keys_values(layer, x)
            per_token = rotated.contents.nb[2]
            new_k = ggml.ggml_view_2d(c.ctx, rotated, kv_size, tokens, per_token, s.num_heads * s.head_dim * 4)
            new_v = ggml.ggml_view_2d(c.ctx, qkv, kv_size, tokens, qkv.contents.nb[1], (q_size + kv_size) * 4)
            stored = []
            for buffer, new in ((cache.keys[i], new_k), (cache.values[i], new_v)):
                whole = ggml.ggml_new_tensor_2d(self._cache_ctx, ggml.GGML_TYPE_F32, kv_size, buffer.numel() // kv_size)
                whole.contents.data = buffer.data_ptr()
                self.cache_pointers.append(buffer.data_ptr())
                written = ggml.ggml_set_rows(c.ctx, whole, new, write)
                # [head_dim, keys, kv_heads, rows] over the rows' slots, from the first slot (moved per step).
                seen = ggml.ggml_view_4d(
                    c.ctx, written, s.head_dim, keys, s.num_kv_heads, rows, kv_size * 4, s.head_dim * 4, slot_bytes, 0
                )
                self._attention_views.append(seen.contents)
                stored.append(seen)
            if gather is None:  # [head_dim, 1, heads, rows]: each token's queries as they lie
                block = ggml.ggml_view_4d(
                    c.ctx, rotated, s.head_dim, 1, s.num_heads, rows, per_token, s.head_dim * 4, per_token, 0
                )
            else:  # [head_dim, queries, heads, rows], gathered from the pack
                packed = ggml.ggml_view_2d(c.ctx, rotated, q_size, tokens, per_token, 0)
                picked = ggml.ggml_get_rows(c.ctx, packed, gather)
                block = ggml.ggml_permute(
                    c.ctx, ggml.ggml_reshape_4d(c.ctx, picked, s.head_dim, s.num_heads, queries, rows), 0, 2, 1, 3
                )
            mask = window_mask if layer.window is not None else full_mask
            attention = ggml.ggml_flash_attn_ext(c.ctx, block, stored[0], stored[1], mask, s.attn_scale, 0.0, 0.0)
            # [head_dim, heads, queries, rows] -> [q_size, tokens]: the o projection's input.
            attention = ggml.ggml_reshape_2d(c.ctx, attention, q_size, padded)
            if scatter is not None:
                attention = ggml.ggml_get_rows(c.ctx, attention, scatter)
            x = c.layer_tail(layer, x, attention)
        x = c.norm(x, steps.final_norm)
        self.graph = ggml.ggml_new_graph_custom(c.ctx, nodes, False)
        ggml.ggml_build_forward_expand(self.graph, x)
        self.x_out = c.view(x, tokens, s.hidden_size)
        self._plan = GraphPlan(self.graph)
        self._slot_bytes, self._max_len = slot_bytes, cache.max_len
        self._window = next((p.window for p in layers if p.window is not None), None)

    def run(self, x: torch.Tensor, positions: torch.Tensor, layout: DecodeLayout, threads: int) -> torch.Tensor:
        """x [tokens, hidden] packed in row order, laid out in the slots as `layout` says."""
        c = self.context
        c.positions_in.copy_(positions)
        self.x_in.copy_(x)
        self.write_in.copy_((layout.first_slot + layout.token_slot) * self._max_len + positions)
        cell = layout.token_slot * self.queries + layout.token_query  # each token's place in the blocks
        # Keys a query sees: its own position + 1; padding sees key 0 only (a finite softmax, output unread).
        lengths = torch.ones(self.rows * self.queries, dtype=torch.long)
        lengths[cell] = positions + 1
        if self.gathered:  # a padding query is token 0's, masked
            picked = torch.zeros(self.rows * self.queries, dtype=torch.int32)
            picked[cell] = torch.arange(self.tokens, dtype=torch.int32)
            self.gather_in.copy_(picked)
            self.scatter_in.copy_(cell)
        lengths = lengths.view(self.rows, self.queries, 1)
        keys = torch.arange(self.keys)[None, None, :]
        visible = keys < lengths
        self.full_mask_in.copy_(torch.where(visible, 0.0, float("-inf")))
        if self._window is not None:
            in_window = visible & (keys >= lengths - self._window)  # padding keeps key 0
            self.window_mask_in.copy_(torch.where(in_window, 0.0, float("-inf")))
        offset = layout.first_slot * self._slot_bytes
        for view, base in zip(self._attention_views, self.cache_pointers, strict=True):
            view.data = base + offset
        self._plan.compute(threads)
        return self.x_out.clone()

    def free(self) -> None:
        self.context.free()
        if self._cache_ctx:
            ggml, _ = ggml_modules()
            ggml.ggml_free(self._cache_ctx)
            self._cache_ctx = None


class GgmlLayerSteps:
    """The decoder's layers for steps of 1 to `max_tokens` tokens. `hidden` takes the embedded tokens
    [T, hidden] and returns each row's final-normed last hidden state [rows, hidden] (float32)."""

    def __init__(
        self,
        shape: StepShape,
        layers: Sequence[LayerParts],
        ropes: Sequence[tuple[torch.Tensor, float]],
        final_norm: torch.Tensor,
        max_tokens: int,
    ) -> None:
        """ropes: per RoPE table, its inverse frequencies [head_dim / 2] and cos/sin scale."""
        self.shape, self.layers, self.max_tokens, self.final_norm = shape, list(layers), max_tokens, final_norm
        if not llamafile_built():
            log.warning("ggml was built without llamafile's tinyBLAS: decode steps of several rows run ~20 % "
                        "slower; rebuild it as the Makefile does (CMAKE_ARGS=-DGGML_LLAMAFILE=ON)")
        gains: list[torch.Tensor] = [final_norm]
        for part in self.layers:
            optional = [part.qkv_bias, part.qk_norm_gain, part.o_bias, part.attn_out_norm, part.gate_up_bias]
            optional += [part.down_bias, part.mlp_out_norm]
            gains += [part.input_norm, part.mlp_norm] + [t for t in optional if t is not None]
        factors = [rope_factors(inv_freq, shape.head_dim) for inv_freq, _ in ropes]
        self.params = GraphParams(list(dict.fromkeys(gains, None)) + [f for _, f in factors])
        # Per table: ggml's base, its factors tensor, the cos/sin scale.
        self.ropes = [
            (base, self.params[table], float(scale)) for (base, table), (_, scale) in zip(factors, ropes, strict=True)
        ]
        self._boundaries: dict[int, _BoundaryGraphs] = {}
        self._decoders: dict[tuple[int, int, int, int, bool], _DecodeGraph] = {}
        self._decoders_cache: tuple[int, ...] = ()
        self.decoder_steps = 0  # steps each form served (for tests and profiling)
        self.multi_query_steps = 0  # decoder steps with a row of several tokens
        self.boundary_steps = 0

    def takes(self, tokens: int) -> bool:
        return 1 <= tokens <= self.max_tokens

    def hidden(self, x: torch.Tensor, positions: torch.Tensor, last: torch.Tensor, attend: Attend) -> torch.Tensor:
        tokens = int(x.shape[0])
        if not self.takes(tokens):
            raise ValueError(f"these layer graphs take 1 to {self.max_tokens} tokens, not {tokens}")
        threads = max(1, torch.get_num_threads())
        # A duck-typed check: isinstance against a runtime-checkable Protocol costs too much to run every step
        # (measured: docs/measured-choices.md#ggml-graphs).
        cache = cast(DecodeCache, attend) if hasattr(attend, "decode_layout") else None
        if cache is not None and cache.keys[0].dtype != torch.float32:
            cache = None
        layout = cache.decode_layout() if cache is not None else None
        if cache is not None and layout is not None:
            # Keys in buckets of powers of two: few graphs, and flash attention skips the masked keys.
            longest = int(positions.max()) + 1
            keys = min(cache.max_len, max(_MIN_KEY_BUCKET, 1 << (longest - 1).bit_length()))
            decoder = self._decoder(cache, (tokens, layout.slots, layout.queries, keys, not layout.direct))
            self.decoder_steps += 1
            self.multi_query_steps += layout.queries > 1
            out = decoder.run(x, positions, layout, threads)
            return out if len(last) == tokens else out.index_select(0, last)
        graphs = self._boundaries.get(tokens)
        if graphs is None:
            graphs = self._boundaries[tokens] = _BoundaryGraphs(self, tokens)
        self.boundary_steps += 1
        out = graphs.run(x, positions, attend, threads)
        return torch.nn.functional.rms_norm(
            out.index_select(0, last), (self.shape.hidden_size,), self.final_norm, self.shape.rms_eps
        )

    def _decoder(self, cache: DecodeCache, shape: tuple[int, int, int, int, bool]) -> _DecodeGraph:
        """The one-graph decoder for this cache and step shape (tokens, slots, queries, keys, gathered; graphs
        point at the cache's buffers: another cache drops them). The most recently used DECODERS_KEPT are kept:
        a batch's shapes recur step after step."""
        pointers = tuple(t.data_ptr() for t in (*cache.keys, *cache.values))
        if pointers != self._decoders_cache:
            for graph in self._decoders.values():
                graph.free()
            self._decoders, self._decoders_cache = {}, pointers
        decoder = self._decoders.pop(shape, None)
        if decoder is None:
            decoder = _DecodeGraph(self, cache, *shape)
            if len(self._decoders) >= DECODERS_KEPT:
                self._decoders.pop(next(iter(self._decoders))).free()  # the least recently used
        self._decoders[shape] = decoder  # re-inserted: the dict's order is the order of use
        return decoder

    def __del__(self) -> None:
        for graphs in getattr(self, "_boundaries", {}).values():
            graphs.context.free()
        for decoder in getattr(self, "_decoders", {}).values():
            decoder.free()
        params = getattr(self, "params", None)
        if params is not None:
            params.free()
