"""A layer of corral's fp16 decoder as ggml's graphs of few tokens take it (corral/kernels/ggml_layers.py): its
products as the fp16 projections' own row kernels (corral/kernels/row_kernel.py), its gains and biases."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from corral.kernels.ggml_graph_parts import LayerParts
from corral.kernels.quantized_projection import QuantizedProjection
from corral.kernels.row_kernel import RowKernel


class DecoderLayer(Protocol):
    """A layer of corral's decoder (corral/server/models/llama_family.py), as far as its graphs need it."""

    @property
    def input_norm(self) -> torch.Tensor: ...
    @property
    def qkv(self) -> Any: ...  # Projection | QuantizedProjection, q, k and v stacked
    @property
    def o(self) -> Any: ...
    @property
    def gate_up(self) -> Any: ...  # gate and up stacked
    @property
    def down(self) -> Any: ...
    @property
    def qk_norm_gain(self) -> torch.Tensor | None: ...
    @property
    def attn_out_norm(self) -> torch.Tensor | None: ...
    @property
    def mlp_norm(self) -> torch.Tensor: ...
    @property
    def mlp_out_norm(self) -> torch.Tensor | None: ...


def layer_parts(layer: DecoderLayer, rope_table: int, window: int | None) -> LayerParts | None:
    """The layer for the graphs; None where a product has no ggml kernel (not fp16, or no ggml)."""
    projections = (layer.qkv, layer.o, layer.gate_up, layer.down)
    biases = [p.bias if isinstance(p, QuantizedProjection) else None for p in projections]
    kernels = _own_kernels(projections)
    if kernels is None:
        return None
    qkv, o, gate_up, down = kernels
    return LayerParts(
        input_norm=layer.input_norm,
        qkv=qkv,
        qkv_bias=biases[0],
        qk_norm_gain=layer.qk_norm_gain,
        o=o,
        o_bias=biases[1],
        attn_out_norm=layer.attn_out_norm,
        mlp_norm=layer.mlp_norm,
        gate_up=gate_up,
        gate_up_bias=biases[2],
        down=down,
        down_bias=biases[3],
        mlp_out_norm=layer.mlp_out_norm,
        rope_table=rope_table,
        window=window,
    )


_Kernels = tuple[tuple[RowKernel, ...], RowKernel, tuple[RowKernel, ...], RowKernel]


def _own_kernels(projections: tuple[Any, ...]) -> _Kernels | None:
    own = [p.row_kernel if isinstance(p, QuantizedProjection) else None for p in projections]
    qkv, o, gate_up, down = own
    if qkv is None or o is None or gate_up is None or down is None:
        return None
    return (qkv,), o, (gate_up,), down
