"""Which ggml kernels multiply a decoder layer's products in steps of few tokens (server/models/ggml_layers.py):
a GGUF's own blocks under `--quantization gguf` (server/models/gguf_blocks.py), else the fp16 projections' own
row kernels (server/models/row_kernel.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch

from server.models.ggml_layers import LayerParts
from server.models.gguf_blocks import QuantBlocks
from server.models.quantized_projection import QuantizedProjection
from server.models.row_kernel import LAYER_MAX_ROWS, RowKernel

# A layer's GGUF weights in the order the graphs take them: q, k, v, o, gate, up, down.
_BLOCK_NAMES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                "mlp.up_proj", "mlp.down_proj")


class DecoderLayer(Protocol):
    """A layer of corral's decoder (server/models/llama_family.py), as far as its graphs need it."""

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


def layer_parts(
    index: int, layer: DecoderLayer, blocks: Mapping[str, QuantBlocks] | None, rope_table: int, window: int | None
) -> LayerParts | None:
    """Layer `index` for the graphs; None where a product has no ggml kernel (not fp16, or no ggml)."""
    projections = (layer.qkv, layer.o, layer.gate_up, layer.down)
    biases = [p.bias if isinstance(p, QuantizedProjection) else None for p in projections]
    kernels = _block_kernels(index, blocks) if blocks is not None else _own_kernels(projections)
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


def _block_kernels(index: int, blocks: Mapping[str, QuantBlocks]) -> _Kernels:
    """Each weight its own kernel over its blocks (a GGUF mixes types, so q, k and v cannot share one)."""
    names = [f"model.layers.{index}.{name}.weight" for name in _BLOCK_NAMES]
    missing = [name for name in names if name not in blocks]
    if missing:
        raise ValueError(f"the GGUF's blocks lack {missing[0]}")
    q, k, v, o, gate, up, down = (RowKernel(blocks[name], max_rows=LAYER_MAX_ROWS) for name in names)
    return (q, k, v), o, (gate, up), down


def _own_kernels(projections: tuple[Any, ...]) -> _Kernels | None:
    own = [p.row_kernel if isinstance(p, QuantizedProjection) else None for p in projections]
    qkv, o, gate_up, down = own
    if qkv is None or o is None or gate_up is None or down is None:
        return None
    return (qkv,), o, (gate_up,), down
