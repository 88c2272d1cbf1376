"""The head's screen for a step of one screened row: ggml's 8-bit block product, the input rounded here.

A one-row step reads the whole head for one row, so its screen wants the fewest bytes through the fastest
one-row kernel, with bounds tight enough that settling is cheap. ggml's Q8_0 layout (blocks of 32 int8 values
with one fp16 scale) serves both: the head is rounded to it once at load (178 MB for Gemma 3 against the fp16
head's 335; Gemma's GGUF stores its embedding in Q8_0, so there the rounding only undoes fp16's), and each row's
input is rounded to it here and handed to ggml as blocks (`RowKernel(input_blocks=True)`), so its rounding, and
with it the bound, is known exactly. Per-block steps keep Gemma's few large hidden dimensions from coarsening
the rest. On an AMD EPYC (AVX2), through Gemma 3, it let through far fewer candidates a row than fbgemm's 7-bit
screen there, and its product was faster than the fp16 head's. ggml multiplies its blocks row by row of the
input, so it screens steps of one row only (corral/kernels/head_screen.py; measured:
docs/measured-choices.md#head-screens).

The bound, per token j, with x̂ and ŵ the rounded input and weights: x̂·ŵ − x·w = x̂·(ŵ − w) + (x̂ − x)·w, at most
‖x̂‖·‖ŵⱼ − wⱼ‖ + ‖x̂ − x‖·‖wⱼ‖, plus float32's rounding in ggml's block sums (int32 sums, one scale product and
one fused add per block) and in `select`'s sum: both inside the `n·2⁻²³·max|w|` per unit of L1 norm that
`float_slack` allows.
"""

from __future__ import annotations

import torch

from corral.kernels.head_screen import float_rounding_per_l1, float_slack
from corral.kernels.row_kernel import QuantBlocks, RowKernel, ggml_modules, row_kernel_available

BLOCK = 32  # values per Q8_0 block, each block 2 bytes of fp16 scale then 32 int8 codes
_FP16_MAX = 65504.0
_CHUNK = 16384  # head rows rounded at a time (bounds the float32 temporaries at load)


def block_screen_available(in_features: int) -> bool:
    """ggml is installed and on, and the head's rows split into whole blocks."""
    return row_kernel_available() and in_features % BLOCK == 0


def q8_0_blocks(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """values [R, K] (K a multiple of 32) in ggml's Q8_0 layout: raw bytes [R, K/32·34], and the float32 values
    [R, K] they stand for (each block's fp16 step × its codes, exact in float32)."""
    rows, width = values.shape
    grouped = values.float().reshape(rows, width // BLOCK, BLOCK)
    scale = (grouped.abs().amax(dim=2) / 127.0).clamp(max=_FP16_MAX).half()
    step = scale.float()
    # Codes against the fp16 step itself, so the values stand for what ggml multiplies; a step that fp16
    # rounds to zero leaves codes of zero (its values are below 1e-5) and an error the bound includes.
    codes = torch.round(grouped / torch.where(step > 0, step, 1.0)[..., None]).clamp_(-127, 127)
    raw = torch.cat([scale.view(torch.uint8).view(rows, -1, 2), codes.to(torch.int8).view(torch.uint8)], dim=2)
    return raw.reshape(rows, -1), (codes * step[..., None]).reshape(rows, width)


def ggml_q8_0_blocks(values: torch.Tensor) -> torch.Tensor:
    """values [R, K] (K a multiple of 32) in Q8_0 blocks [R, K/32·34] as ggml's CPU quantizer writes a product's
    input on x86 (each value times 127/amax in float32, rounded to nearest even; the step amax/127 in fp16), so a
    product handed these blocks sums what one handed the floats does."""
    rows, width = values.shape
    grouped = values.float().reshape(rows, width // BLOCK, BLOCK)
    peak = grouped.abs().amax(dim=2)
    inverse = torch.where(peak > 0, 127.0 / torch.where(peak > 0, peak, 1.0), 0.0)
    codes = torch.round(grouped * inverse[..., None]).to(torch.int8)
    scale = (peak / 127.0).half()
    return torch.cat([scale.view(torch.uint8).view(rows, -1, 2), codes.view(torch.uint8)], dim=2).reshape(rows, -1)


class BlockScreen:
    """The Q8_0 screen of one fp16 head [vocab, in_features] (its weights as the fp16 head holds them), for one
    row at a time. Its attributes mean what `head_screen.Screen` says."""

    def __init__(self, weight: torch.Tensor) -> None:
        ggml, _ = ggml_modules()
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        if self.in_features % BLOCK:
            raise ValueError(f"a Q8_0 screen needs rows of whole {BLOCK}-value blocks, not {self.in_features}")
        vocab = self.out_features
        raw = torch.empty(vocab, self.in_features // BLOCK * (BLOCK + 2), dtype=torch.uint8)
        self.error_norms = torch.empty(vocab)  # ‖ŵⱼ − wⱼ‖
        self.rounded_norms = torch.empty(vocab)  # ‖wⱼ‖: what the input's rounding meets here
        for lo in range(0, vocab, _CHUNK):
            w = weight[lo : lo + _CHUNK].detach().float().half().float()  # the values fp16's kernels compute with
            blocks, rounded = q8_0_blocks(w)
            raw[lo : lo + len(w)] = blocks
            self.error_norms[lo : lo + len(w)] = (rounded - w).norm(dim=1)
            self.rounded_norms[lo : lo + len(w)] = w.norm(dim=1)
        self.rounding_per_l1 = float_rounding_per_l1(weight)
        self._bytes = raw.numel()
        blocks_of = QuantBlocks(raw.numpy(), int(ggml.GGML_TYPE_Q8_0), "Q8_0", vocab, self.in_features)
        self._kernel = RowKernel(blocks_of, max_rows=1, input_blocks=True)

    @property
    def weight_bytes(self) -> int:
        """Bytes one screened row reads: the head's Q8_0 blocks."""
        return self._bytes

    def logits(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Screened logits [1, V] of x [1, in_features], with the L2 norms of its rounded input and of that
        rounding (each [1])."""
        x = x.float()
        blocks, rounded = q8_0_blocks(x)
        return self._kernel(blocks), rounded.norm(dim=1), (x - rounded).norm(dim=1)

    def slack(self, input_l1: torch.Tensor) -> torch.Tensor:
        """float32's rounding, for inputs of these L1 norms."""
        return float_slack(self.rounding_per_l1, input_l1)
