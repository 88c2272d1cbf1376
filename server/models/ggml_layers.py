"""A decode step of few tokens through ggml graphs, one per layer boundary: the decoder's small arithmetic off torch.

With its products on ggml (row_kernel.py), a one-row step of Gemma 3 270M still spent ~6 ms of ~28 outside
them: some 25 torch calls per layer (norms, the per-head q/k norm, RoPE, the gate, residual adds, views and
casts), each a few microseconds of dispatch for a few hundred numbers (profiled: the 91 RMS norms alone
2.5 ms). ggml runs the same arithmetic as nodes of one graph, a node for a few hundred numbers costing about
a microsecond. Only attention stays in torch, whose KV cache it reads and writes: a step of L layers is L + 1
graphs, each from one layer's attention output to the next one's queries, keys and values:

    graph 0:   x -> input norm -> qkv -> q/k norm -> RoPE                         (layer 0's q, k, v)
    graph i:   layer i-1's attention -> o -> [norm] -> + x -> norm -> gate/up -> GELU or SiLU gate
               -> down -> [norm] -> + x -> layer i's input norm -> qkv -> q/k norm -> RoPE
    graph L:   the last layer's tail, ending at the residual stream x

The products multiply the same fp16 weights the row kernels hold (no second copy). Arithmetic matches the
torch path up to ggml's roundings: a product's input is rounded to fp16 (as in row_kernel.py), and ggml's GELU
reads a table indexed by the fp16-rounded gate (llama.cpp computes Gemma this way). RoPE uses the model's own
frequencies (as ggml frequency factors), so scaled variants need nothing of their own.

Graphs are built once per token count (1 to `max_tokens`) on first use; their inputs and outputs live in
ggml's memory and torch reads and writes them in place as views.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from server.models.row_kernel import RowKernel, ggml_modules, run_graph

_ROPE_NEOX = 2  # ggml's RoPE mode for the Hugging Face layout (pairs are the two halves of head_dim)
_GRAPH_NODES = 64  # a boundary has ~20 nodes; ggml's default graph reserves 2048


class Attend(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class LayerParts:
    """One decoder layer as the graphs need it: products as row kernels, gains and biases as float tensors."""

    input_norm: torch.Tensor
    qkv: RowKernel
    qkv_bias: torch.Tensor | None
    qk_norm_gain: torch.Tensor | None  # [heads + kv_heads, head_dim]
    o: RowKernel
    o_bias: torch.Tensor | None
    attn_out_norm: torch.Tensor | None  # sandwich norms (Gemma)
    mlp_norm: torch.Tensor
    gate_up: RowKernel
    gate_up_bias: torch.Tensor | None
    down: RowKernel
    down_bias: torch.Tensor | None
    mlp_out_norm: torch.Tensor | None
    rope_table: int


@dataclass(frozen=True)
class StepShape:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    activation: str  # "silu" or "gelu_tanh"


class _Params:
    """The layers' gains and biases, and the RoPE frequency factors, copied into one ggml context."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        ggml, _ = ggml_modules()
        size = sum(t.numel() * 4 for t in tensors) + len(tensors) * (ggml.ggml_tensor_overhead() + 64) + 4096
        self.ctx: Any = ggml.ggml_init(ggml.ggml_init_params(mem_size=size, mem_buffer=None, no_alloc=False))
        if not self.ctx:
            raise MemoryError(f"ggml could not allocate {size} bytes for the layers' gains")
        self._by_id: dict[int, Any] = {}
        for tensor in tensors:
            self._by_id[id(tensor)] = self._copy(tensor)

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


class _Boundary:
    """One graph: from layer i-1's attention output (absent for i = 0) to layer i's q, k, v (absent for i = L)."""

    def __init__(self, owner: _TokenGraphs, before: LayerParts | None, after: LayerParts | None) -> None:
        ggml, utils = ggml_modules()
        s, ctx, tokens = owner.shape, owner.ctx, owner.tokens
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        heads = s.num_heads + s.num_kv_heads
        params = owner.params

        def view(tensor: Any, *shape: int) -> torch.Tensor:
            return torch.from_numpy(utils.to_numpy(tensor)).view(*shape)

        def norm(x: Any, gain: torch.Tensor) -> Any:
            return ggml.ggml_mul(ctx, ggml.ggml_rms_norm(ctx, x, s.rms_eps), params[gain])

        def product(kernel: RowKernel, x: Any, bias: torch.Tensor | None) -> Any:
            y = ggml.ggml_mul_mat(ctx, kernel.ggml_weight, x)
            return y if bias is None else ggml.ggml_add(ctx, y, params[bias])

        x_in = ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_F32, s.hidden_size, tokens)
        self.x_in = view(x_in, tokens, s.hidden_size)
        self.attn_in: torch.Tensor | None = None
        x = x_in
        if before is not None:
            attn = ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_F32, q_size, tokens)
            self.attn_in = view(attn, tokens, q_size)
            out = product(before.o, attn, before.o_bias)
            if before.attn_out_norm is not None:
                out = norm(out, before.attn_out_norm)
            x = ggml.ggml_add(ctx, x, out)
            gate_up = product(before.gate_up, norm(x, before.mlp_norm), before.gate_up_bias)
            gated = ggml.ggml_swiglu(ctx, gate_up) if s.activation == "silu" else ggml.ggml_geglu(ctx, gate_up)
            out = product(before.down, gated, before.down_bias)
            if before.mlp_out_norm is not None:
                out = norm(out, before.mlp_out_norm)
            x = ggml.ggml_add(ctx, x, out)
        self.graph = ggml.ggml_new_graph_custom(ctx, _GRAPH_NODES, False)
        ggml.ggml_build_forward_expand(self.graph, x)
        self.x_out = view(x, tokens, s.hidden_size)
        self.q: torch.Tensor | None = None
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        if after is not None:
            qkv = product(after.qkv, norm(x, after.input_norm), after.qkv_bias)
            row_bytes = (q_size + 2 * kv_size) * 4
            qk = ggml.ggml_view_3d(ctx, qkv, s.head_dim, heads, tokens, s.head_dim * 4, row_bytes, 0)
            if after.qk_norm_gain is not None:
                qk = norm(qk, after.qk_norm_gain)
            base, factors, scale = owner.ropes[after.rope_table]
            rotated = ggml.ggml_rope_ext(
                ctx, qk, owner.positions, factors, s.head_dim, _ROPE_NEOX, 0, base, 1.0, 0.0, scale, 0.0, 0.0
            )
            ggml.ggml_build_forward_expand(self.graph, rotated)
            qk_view = view(rotated, tokens, heads, s.head_dim)
            self.q, self.k = qk_view[:, : s.num_heads], qk_view[:, s.num_heads :]
            qkv_view = view(qkv, tokens, q_size + 2 * kv_size)
            self.v = qkv_view[:, q_size + kv_size :].view(tokens, s.num_kv_heads, s.head_dim)
        self._plans: dict[int, tuple[Any, np.ndarray]] = {}

    def compute(self, threads: int) -> None:
        if threads not in self._plans:
            ggml, _ = ggml_modules()
            plan = ggml.ggml_graph_plan(self.graph, threads, None)
            work = np.zeros(max(int(plan.work_size), 1), dtype=np.uint8)
            plan.work_data = work.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
            self._plans[threads] = (plan, work)  # the buffer lives as long as the plan that points at it
        run_graph(self.graph, self._plans[threads][0])


class _TokenGraphs:
    """Every boundary's graph for one number of tokens, in one ggml context."""

    def __init__(self, steps: GgmlLayerSteps, tokens: int) -> None:
        ggml, utils = ggml_modules()
        self.shape, self.params, self.tokens = steps.shape, steps.params, tokens
        s = steps.shape
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        widest = max(part.gate_up.out_features for part in steps.layers)
        # Every node has its own memory (no reuse): a boundary holds ~10 hidden-wide vectors, qkv twice and
        # the MLP's gate/up and gated vectors per token. Sized with room to spare: ggml aborts when it runs out.
        per_boundary = tokens * 4 * (12 * s.hidden_size + 3 * (q_size + 2 * kv_size) + 2 * widest)
        per_boundary += 48 * ggml.ggml_tensor_overhead() + ggml.ggml_graph_overhead_custom(_GRAPH_NODES, False)
        size = 2 * per_boundary * (len(steps.layers) + 1) + (1 << 16)
        self.ctx: Any = ggml.ggml_init(ggml.ggml_init_params(mem_size=size, mem_buffer=None, no_alloc=False))
        if not self.ctx:
            raise MemoryError(f"ggml could not allocate {size} bytes for {tokens}-token layer graphs")
        self.positions = ggml.ggml_new_tensor_1d(self.ctx, ggml.GGML_TYPE_I32, tokens)
        self.positions_in = torch.from_numpy(utils.to_numpy(self.positions)).view(tokens)
        self.ropes = steps.ropes
        layers = steps.layers
        self.boundaries = [
            _Boundary(self, layers[i - 1] if i > 0 else None, layers[i] if i < len(layers) else None)
            for i in range(len(layers) + 1)
        ]

    def free(self) -> None:
        ggml, _ = ggml_modules()
        if self.ctx:
            ggml.ggml_free(self.ctx)
            self.ctx = None


class GgmlLayerSteps:
    """The decoder's layers for steps of 1 to `max_tokens` tokens: `run` takes the embedded tokens [T, hidden]
    and returns the residual stream after the last layer [T, hidden] (float32), attention through `attend`."""

    def __init__(
        self,
        shape: StepShape,
        layers: Sequence[LayerParts],
        ropes: Sequence[tuple[torch.Tensor, float]],
        max_tokens: int,
    ) -> None:
        """ropes: per RoPE table, its inverse frequencies [head_dim / 2] and cos/sin scale."""
        self.shape, self.layers, self.max_tokens = shape, list(layers), max_tokens
        gains: list[torch.Tensor] = []
        for part in self.layers:
            optional = [part.qkv_bias, part.qk_norm_gain, part.o_bias, part.attn_out_norm, part.gate_up_bias]
            optional += [part.down_bias, part.mlp_out_norm]
            gains += [part.input_norm, part.mlp_norm] + [t for t in optional if t is not None]
        factors = [_rope_factors(inv_freq, shape.head_dim) for inv_freq, _ in ropes]
        self.params = _Params(list(dict.fromkeys(gains, None)) + [f for _, f in factors])
        # Per table: ggml's base, its factors tensor, the cos/sin scale.
        self.ropes = [
            (base, self.params[table], float(scale)) for (base, table), (_, scale) in zip(factors, ropes, strict=True)
        ]
        self._graphs: dict[int, _TokenGraphs] = {}

    def takes(self, tokens: int) -> bool:
        return 1 <= tokens <= self.max_tokens

    def run(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        tokens = int(x.shape[0])
        if not self.takes(tokens):
            raise ValueError(f"these layer graphs take 1 to {self.max_tokens} tokens, not {tokens}")
        graphs = self._graphs.get(tokens)
        if graphs is None:
            graphs = self._graphs[tokens] = _TokenGraphs(self, tokens)
        threads = max(1, torch.get_num_threads())
        graphs.positions_in.copy_(positions)
        first = graphs.boundaries[0]
        first.x_in.copy_(x)
        for i, boundary in enumerate(graphs.boundaries):
            boundary.compute(threads)
            if i == len(self.layers):
                return boundary.x_out.clone()
            assert boundary.q is not None and boundary.k is not None and boundary.v is not None
            attn = attend(i, boundary.q, boundary.k, boundary.v)
            following = graphs.boundaries[i + 1]
            assert following.attn_in is not None
            following.attn_in.copy_(attn.reshape(tokens, -1))
            following.x_in.copy_(boundary.x_out)
        raise AssertionError("unreachable: the last boundary returns")

    def __del__(self) -> None:
        for graphs in getattr(self, "_graphs", {}).values():
            graphs.free()
        params = getattr(self, "params", None)
        if params is not None:
            params.free()


def _rope_factors(inv_freq: torch.Tensor, head_dim: int) -> tuple[float, torch.Tensor]:
    """A base and per-pair factors with which ggml's RoPE (theta_i = pos * base^(-2i/d) / factor_i) gives the
    model's frequencies exactly as listed, whatever variant produced them (linear, llama3, yarn...)."""
    inv = inv_freq.double()
    base = float(inv[1].item() ** (-head_dim / 2)) if len(inv) > 1 and float(inv[1]) > 0 else 10000.0
    if not math.isfinite(base) or base <= 1.0:
        base = 10000.0
    pairs = torch.arange(len(inv), dtype=torch.float64)
    return base, (base ** (-2.0 * pairs / head_dim) / inv).float()
