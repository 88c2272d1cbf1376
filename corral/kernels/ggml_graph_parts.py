"""The pieces every ggml graph of the decoder is built from: a layer's weights and gains, the step's shape,
the gains copied into ggml, and the node helpers (norms, products, q/k/v with RoPE, a layer's tail) that the
graphs of few tokens (ggml_layers.py) and of any step (ggml_step_graph.py) share."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from corral.kernels.row_kernel import ggml_modules

ROPE_NEOX = 2  # ggml's RoPE mode for the Hugging Face layout (pairs are the two halves of head_dim)
ROPE_NORMAL = 0  # adjacent pairs: a `llama` GGUF, whose q/k rows llama.cpp's converter interleaved for it


class GraphWeight(Protocol):
    """A weight as a graph multiplies it: a ggml tensor [in_features, out_features] (a row kernel's, or a GGUF's
    over its memory map), which may depend on the product's rows (a GGUF's repacked weight or its own blocks)."""

    @property
    def out_features(self) -> int: ...
    def for_rows(self, rows: int) -> Any: ...


@dataclass(frozen=True)
class LayerParts:
    """One decoder layer as the graphs need it: products as ggml weights, gains and biases as float tensors."""

    input_norm: torch.Tensor
    qkv: tuple[GraphWeight, ...]  # one weight for q, k and v together, or three (a GGUF's blocks, each its type)
    qkv_bias: torch.Tensor | None
    qk_norm_gain: torch.Tensor | None  # [heads + kv_heads, head_dim]
    o: GraphWeight
    o_bias: torch.Tensor | None
    attn_out_norm: torch.Tensor | None  # sandwich norms (Gemma)
    mlp_norm: torch.Tensor
    gate_up: tuple[GraphWeight, ...]  # gate and up together, or two
    gate_up_bias: torch.Tensor | None
    down: GraphWeight
    down_bias: torch.Tensor | None
    mlp_out_norm: torch.Tensor | None
    rope_table: int
    window: int | None  # the layer's sliding window; None: full attention


@dataclass(frozen=True)
class StepShape:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    activation: str  # "silu" or "gelu_tanh"
    attn_scale: float  # the queries' scale in attention
    rope_mode: int = ROPE_NEOX


class GraphParams:
    """The layers' gains and biases, and the RoPE frequency factors, copied into one ggml context."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        ggml, _ = ggml_modules()
        size = sum(t.numel() * 4 for t in tensors) + len(tensors) * (ggml.ggml_tensor_overhead() + 64) + 4096
        self.ctx: Any = ggml.ggml_init(ggml.ggml_init_params(mem_size=size, mem_buffer=None, no_alloc=False))
        if not self.ctx:
            raise MemoryError(f"ggml could not allocate {size} bytes for the layers' gains")
        self._by_id: dict[int, Any] = {id(t): self._copy(t) for t in tensors}

    def _copy(self, tensor: torch.Tensor) -> Any:
        ggml, utils = ggml_modules()
        flat = tensor.detach().float().contiguous()
        dims = list(reversed(flat.shape)) or [1]
        if len(dims) == 1:
            made = ggml.ggml_new_tensor_1d(self.ctx, ggml.GGML_TYPE_F32, dims[0])
        else:
            made = ggml.ggml_new_tensor_2d(self.ctx, ggml.GGML_TYPE_F32, dims[0], dims[1])
        torch.from_numpy(utils.to_numpy(made)).view(flat.shape).copy_(flat)
        return made

    def __getitem__(self, tensor: torch.Tensor) -> Any:
        return self._by_id[id(tensor)]

    def free(self) -> None:
        ggml, _ = ggml_modules()
        if self.ctx:
            ggml.ggml_free(self.ctx)
            self.ctx = None


class GraphParts(Protocol):
    """What the node helpers read of a decoder: its shape, gains (in one ggml context) and RoPE tables."""

    shape: StepShape
    params: Any  # GraphParams
    ropes: list[tuple[float, Any, float]]  # per table: ggml's base, its factors tensor, the cos/sin scale


class GraphContext:
    """A ggml context and the node-building helpers the graph forms share. `allocate`: every tensor gets its own
    memory here (graphs of few tokens); else the tensors are only described, and a graph allocator gives the
    built graph memory that nodes reuse once read (corral/kernels/ggml_step_graph.py: any number of tokens)."""

    def __init__(self, steps: GraphParts, tokens: int, size: int, allocate: bool = True) -> None:
        ggml, utils = ggml_modules()
        self.ggml, self.utils = ggml, utils
        self.steps, self.shape, self.params, self.tokens = steps, steps.shape, steps.params, tokens
        params = ggml.ggml_init_params(mem_size=size, mem_buffer=None, no_alloc=not allocate)
        self.ctx: Any = ggml.ggml_init(params)
        if not self.ctx:
            raise MemoryError(f"ggml could not allocate {size} bytes for {tokens}-token layer graphs")
        self.positions = ggml.ggml_new_tensor_1d(self.ctx, ggml.GGML_TYPE_I32, tokens)
        if allocate:
            self.positions_in = self.view(self.positions, tokens)

    def view(self, tensor: Any, *shape: int) -> torch.Tensor:
        """Torch's view of a tensor in this context's memory."""
        return torch.from_numpy(self.utils.to_numpy(tensor)).view(*shape)

    def new(self, kind: int, *dims: int) -> Any:
        return getattr(self.ggml, f"ggml_new_tensor_{len(dims)}d")(self.ctx, kind, *dims)

    def norm(self, x: Any, gain: torch.Tensor) -> Any:
        g = self.ggml
        return g.ggml_mul(self.ctx, g.ggml_rms_norm(self.ctx, x, self.shape.rms_eps), self.params[gain])

    def product(self, kernels: GraphWeight | tuple[GraphWeight, ...], x: Any, bias: torch.Tensor | None) -> Any:
        """x times each kernel's weight, the outputs stacked in order (as one weight of their rows would give)."""
        g = self.ggml
        each = kernels if isinstance(kernels, tuple) else (kernels,)
        rows = int(x.contents.ne[1])
        outputs = [g.ggml_mul_mat(self.ctx, k.for_rows(rows), x) for k in each]
        y = outputs[0]
        for more in outputs[1:]:
            y = g.ggml_concat(self.ctx, y, more, 0)
        return y if bias is None else g.ggml_add(self.ctx, y, self.params[bias])

    def queries_keys_values(self, layer: LayerParts, x: Any) -> tuple[Any, Any]:
        """qkv [q + 2 kv, T] (values in its last kv columns) and the normed, rotated q and k [hd, heads + kv, T]."""
        g, s, ctx = self.ggml, self.shape, self.ctx
        qkv = self.product(layer.qkv, self.norm(x, layer.input_norm), layer.qkv_bias)
        heads = s.num_heads + s.num_kv_heads
        qk = g.ggml_view_3d(ctx, qkv, s.head_dim, heads, self.tokens, s.head_dim * 4, qkv.contents.nb[1], 0)
        if layer.qk_norm_gain is not None:
            qk = self.norm(qk, layer.qk_norm_gain)
        base, factors, scale = self.steps.ropes[layer.rope_table]
        rotated = g.ggml_rope_ext(
            ctx, qk, self.positions, factors, s.head_dim, s.rope_mode, 0, base, 1.0, 0.0, scale, 0.0, 0.0
        )
        return qkv, rotated

    def layer_tail(self, layer: LayerParts, x: Any, attention: Any, rows: Any = None) -> Any:
        """The rest of a layer from its attention output [q_size, T]: o, the residual add, the MLP's. `rows`
        (the last layer's): only these tokens go on, the rest of the step needs no more of this layer."""
        g, s, ctx = self.ggml, self.shape, self.ctx
        if rows is not None:
            attention, x = g.ggml_get_rows(ctx, attention, rows), g.ggml_get_rows(ctx, x, rows)
        out = self.product(layer.o, attention, layer.o_bias)
        if layer.attn_out_norm is not None:
            out = self.norm(out, layer.attn_out_norm)
        x = g.ggml_add(ctx, x, out)
        h = self.norm(x, layer.mlp_norm)
        if len(layer.gate_up) == 2 and layer.gate_up_bias is None:  # separate weights: no stacking copy
            gate, up = (self.product(k, h, None) for k in layer.gate_up)
            split = g.ggml_swiglu_split if s.activation == "silu" else g.ggml_geglu_split
            gated = split(ctx, gate, up)
        else:
            gate_up = self.product(layer.gate_up, h, layer.gate_up_bias)
            gated = g.ggml_swiglu(ctx, gate_up) if s.activation == "silu" else g.ggml_geglu(ctx, gate_up)
        out = self.product(layer.down, gated, layer.down_bias)
        if layer.mlp_out_norm is not None:
            out = self.norm(out, layer.mlp_out_norm)
        return g.ggml_add(ctx, x, out)

    def free(self) -> None:
        if self.ctx:
            self.ggml.ggml_free(self.ctx)
            self.ctx = None


def rope_factors(inv_freq: torch.Tensor, head_dim: int) -> tuple[float, torch.Tensor]:
    """A base and per-pair factors with which ggml's RoPE (theta_i = pos * base^(-2i/d) / factor_i) gives the
    model's frequencies exactly as listed, whatever variant produced them (linear, llama3, yarn...)."""
    inv = inv_freq.double()
    base = float(inv[1].item() ** (-head_dim / 2)) if len(inv) > 1 and float(inv[1]) > 0 else 10000.0
    if not math.isfinite(base) or base <= 1.0:
        base = 10000.0
    pairs = torch.arange(len(inv), dtype=torch.float64)
    return base, (base ** (-2.0 * pairs / head_dim) / inv).float()
