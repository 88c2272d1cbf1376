"""Quantized projections on CPU, through torch's own int8 and int4 kernels and fbgemm's (integer for w8a8,
half-precision weights for fp16).

A decode step of a model like Gemma 3 270M reads every weight once per token; at float32 that is 1.07 GB, and
reading it bounds the step on a CPU core. Storing the weights in 8 or 4 bits and widening them inside the matmul
cuts those bytes 4-8x. torch ships the kernels (`_weight_int8pack_mm`: int8 per output channel;
`_weight_int4pack_mm_for_cpu`: int4 in groups along the input axis with a scale and an offset per group, the
kernels torchao's weight-only configs call on CPU); corral only quantizes and packs the weights for them. Both
kernels are fast with bfloat16 activations and slow (a reference loop) with float32 ones, so a call rounds its
input to bfloat16 and widens the output back (measured: docs/measured-choices.md#projections).

fp16 stores each weight in 16 bits and multiplies in float32 (fbgemm's `linear_dynamic_fp16`, the weights
widened in registers with F16C): twice int8's bytes, but on an AVX2 core without VNNI it is the faster kernel
(Gemma's head at one row: docs/models.md#weight-only-quantization---quantization) and its logits stay within
~1e-2 of float32's.

`select` computes single outputs from the same quantized values the kernel uses, so a grammar-restricted
row (corral/server/models/llama_family.py restricted_logits) sees the logits a full projection would give it.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

import torch
import torch.nn.functional as F

from corral.kernels.row_kernel import LAYER_MAX_ROWS, RowKernel, row_kernel_available

# gguf: a GGUF's own blocks on ggml (corral/server/models/gguf_decoder.py), not a mode of these projections.
Quantization = Literal["none", "int8", "int4", "w8a8", "fp16", "fp16-w8a8", "gguf"]
QUANTIZATIONS: tuple[Quantization, ...] = ("none", "int8", "int4", "w8a8", "fp16", "fp16-w8a8", "gguf")

INT4_GROUP = 32  # weights per scale/offset along the input axis: the GGUF Q4_K sub-block, 4.5-5 bits a weight
_INT4_LEVELS = 15
_INT4_MID = 8  # the kernel reads code q as (q - 8) * scale + offset
_INT4_OUT_TILE = 16  # the int4 kernel's packing wants out_features in multiples of this
_ACTIVATION = torch.bfloat16


# The modes whose kernels are fbgemm's, which x86 builds of torch carry and ARM builds do not.
FBGEMM_MODES: frozenset[Quantization] = frozenset({"w8a8", "fp16", "fp16-w8a8"})


def fbgemm_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


_HEAD_QUANTIZATION: dict[Quantization, Quantization] = {"int4": "int8", "fp16-w8a8": "w8a8"}
_LAYER_QUANTIZATION: dict[Quantization, Quantization] = {"w8a8": "int8", "fp16-w8a8": "fp16"}


def head_quantization(quantization: Quantization) -> Quantization:
    """The output head's: int4 models keep an int8 head, as llama.cpp's Q4_K_M files keep theirs at 6-8 bits
    (Gemma 3 270M's is Q8_0): the logits are the one place every rounding error reaches the choice of token.
    The `-w8a8` modes multiply the head with integer dot products: on AVX2 without VNNI the cheapest of the
    kernels at every batch (Gemma 3's head; measured: docs/measured-choices.md#projections)."""
    return _HEAD_QUANTIZATION.get(quantization, quantization)


def layer_quantization(quantization: Quantization) -> Quantization:
    """The decoder layers' projections': w8a8 rounds only the head's inputs (the layers' activations carry
    outliers that one 7-bit scale per call loses: measured in docs/models.md), so its layers are int8, and
    fp16-w8a8's fp16."""
    return _LAYER_QUANTIZATION.get(quantization, quantization)


def quantizable(weight: torch.Tensor, quantization: Quantization) -> bool:
    """Whether `quantization` applies to this weight (CPU float weights whose input axis fits the groups)."""
    if quantization == "none" or weight.device.type != "cpu" or not weight.is_floating_point():
        return False
    return quantization != "int4" or weight.shape[1] % INT4_GROUP == 0


class QuantizedProjection:
    """y = x Wᵀ + b with W held in int8 (per output channel), int4 (per group of 32 inputs) or float16; under
    w8a8 the input is rounded to int8 too, per call, and the product is an integer one (fbgemm).

    keep_rows (fp16): keep a reference to `weight` for `select` and `dequantized_rows` (fbgemm's packing
    cannot be read back row by row). A head passes views of the embedding it keeps anyway; a layer, whose
    rows nothing selects, passes False so its float weight can be freed.
    row_kernel (fp16): up to LAYER_MAX_ROWS rows go through ggml's fp16 kernel where installed
    (corral/kernels/row_kernel.py), which reads the weight at the memory's speed where fbgemm's does not; more
    rows stay with fbgemm."""

    __slots__ = (
        "_bias",
        "_codes",
        "_mode",
        "_offsets",
        "_packed",
        "_row",
        "_scale_offsets",
        "_scales",
        "bits",
        "in_features",
        "out_features",
    )

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        quantization: Quantization,
        *,
        keep_rows: bool = True,
        row_kernel: bool = False,
    ) -> None:
        if not quantizable(weight, quantization):
            raise ValueError(f"cannot quantize a {tuple(weight.shape)} {weight.dtype} weight to {quantization}")
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self._bias = bias
        self._mode = quantization
        w = weight.detach().float()
        self._offsets: torch.Tensor | None = None
        self._scale_offsets: torch.Tensor | None = None
        use_row_kernel = quantization == "fp16" and row_kernel and row_kernel_available()
        self._row = RowKernel(w, max_rows=LAYER_MAX_ROWS) if use_row_kernel else None
        if quantization == "fp16":
            self.bits = 16
            self._codes = w if keep_rows else torch.empty(0)
            self._scales = torch.empty(0)
            self._packed = torch.ops.quantized.linear_prepack_fp16(w, None)
        elif quantization in ("int8", "w8a8"):
            self.bits = 8
            scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
            self._codes = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
            self._scales = scales.to(_ACTIVATION) if quantization == "int8" else scales
            self._packed = self._codes if quantization == "int8" else prepack_w8a8(self._codes, scales)
        else:
            self.bits = 4
            groups = w.view(self.out_features, -1, INT4_GROUP)
            low, high = groups.amin(dim=-1), groups.amax(dim=-1)
            scales = ((high - low) / _INT4_LEVELS).clamp(min=1e-12)
            codes = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, _INT4_LEVELS)
            self._codes = codes.to(torch.uint8).view(self.out_features, self.in_features)
            self._scales = scales.to(_ACTIVATION)
            self._offsets = (low + _INT4_MID * scales).to(_ACTIVATION)
            # The kernel wants its own packing of the codes, with outputs in whole tiles of 16 (padded with
            # zero rows whose outputs are dropped), and [groups, out, 2] (scale, offset).
            pad = -self.out_features % _INT4_OUT_TILE
            codes32 = F.pad(self._codes.to(torch.int32), (0, 0, 0, pad))
            self._packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes32, 1)
            scale_offsets = torch.stack((self._scales, self._offsets), dim=-1)
            self._scale_offsets = F.pad(scale_offsets, (0, 0, 0, 0, 0, pad)).transpose(0, 1).contiguous()

    @property
    def packed(self) -> bool:
        return True

    @property
    def row_kernel(self) -> RowKernel | None:
        """The ggml kernel that takes few rows (fp16 with row_kernel=True where ggml is installed), else None."""
        return self._row

    @property
    def bias(self) -> torch.Tensor | None:
        return self._bias

    @property
    def rounds_outputs(self) -> bool:
        """Whether outputs come back rounded to bfloat16 (int8, int4), so that `select` is the exact value
        (corral/kernels/logit_refinement.py); w8a8's integer product returns float32, and fp16's too unless
        a few rows go to ggml, which rounds their input to fp16."""
        return self._mode not in ("w8a8", "fp16") or self._row is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._mode == "fp16":
            flat = x.reshape(-1, self.in_features).float()
            product: torch.Tensor
            if self._row is not None and self._row.takes(flat.shape[0]):
                product = self._row(flat)
            else:
                product = torch.ops.quantized.linear_dynamic_fp16(flat, self._packed)
            result = product.to(x.dtype).view(*x.shape[:-1], self.out_features)
            return result if self._bias is None else result + self._bias
        if self._mode == "w8a8":
            # The input is rounded to 7 bits with one scale for the call (fbgemm's dynamic linear, reduced range):
            # AVX2's u8 x s8 pair sums saturate at 16 bits with full-range inputs (measured: 22 % off, 1.5 % reduced).
            flat = x.reshape(-1, self.in_features).float()
            dynamic: torch.Tensor = torch.ops.quantized.linear_dynamic(flat, self._packed, True)
            widened = dynamic.to(x.dtype).view(*x.shape[:-1], self.out_features)
            return widened if self._bias is None else widened + self._bias
        flat = x.reshape(-1, self.in_features).to(_ACTIVATION)
        out: torch.Tensor
        if self.bits == 8:
            out = torch._weight_int8pack_mm(flat, self._packed, self._scales)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self._packed, INT4_GROUP, self._scale_offsets)
            out = out[:, : self.out_features]
        out = out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return out if self._bias is None else out + self._bias

    def dequantized_rows(self, index: torch.Tensor) -> torch.Tensor:
        """Float32 rows `index` of W as the kernel sees them (bfloat16 scales included)."""
        if self.bits == 16:
            if self._codes.numel() == 0:
                raise ValueError("this fp16 projection kept no rows to select from (keep_rows=False)")
            return self._codes.index_select(0, index).half().float()
        codes = self._codes.index_select(0, index).float()
        scales = self._scales.index_select(0, index).float()
        if self.bits == 8:
            return codes * scales[:, None]
        assert self._offsets is not None
        offsets = self._offsets.index_select(0, index).float()
        grouped = (codes.view(len(index), -1, INT4_GROUP) - _INT4_MID) * scales[..., None] + offsets[..., None]
        return grouped.view(len(index), self.in_features)

    def select(self, x: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        """Only the outputs (rows[i], columns[i]) of x Wᵀ + b, for x [R, in_features]: [len(rows)] values."""
        inputs = x.index_select(0, rows).float()
        if self._mode not in ("w8a8", "fp16"):
            inputs = inputs.to(_ACTIVATION).float()  # as the kernel rounds its input
        values = (self.dequantized_rows(columns) * inputs).sum(-1)
        return values if self._bias is None else values + self._bias.index_select(0, columns)

    @property
    def weight_bytes(self) -> int:
        """Bytes a full call reads: codes (as packed) and the per-channel or per-group scales."""
        code_bytes = self.out_features * self.in_features * self.bits // 8
        extra = self._scales.numel() * self._scales.element_size()
        extra += self._offsets.numel() * 2 if self._offsets is not None else 0
        return code_bytes + extra


def prepack_w8a8(codes: torch.Tensor, scales: torch.Tensor) -> Any:
    """fbgemm's packed int8 weight (per-channel scales) for `quantized.linear_dynamic`."""
    with warnings.catch_warnings():  # torch marks its quantized-tensor constructors deprecated; the ops remain
        warnings.simplefilter("ignore")
        zero_points = torch.zeros(len(scales), dtype=torch.long)
        quantized = torch._make_per_channel_quantized_tensor(codes, scales.double(), zero_points, 0)
        return torch.ops.quantized.linear_prepack(quantized, None)
