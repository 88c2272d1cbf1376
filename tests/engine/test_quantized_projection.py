"""Weight-only int8/int4 projections: what torch's kernels compute is the quantized weight times the input,
the quantized weight is close to the original, and a restricted head row sees the full head's logits."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from corral.kernels import split_projection
from corral.kernels.quantized_projection import (
    INT4_GROUP,
    QuantizedProjection,
    head_quantization,
    layer_quantization,
    quantizable,
)
from corral.kernels.split_projection import SplitProjection, head_projection


@pytest.fixture
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)) * 0.05


# w8a8 also rounds the input to 7 bits per call: a looser bound (a full-range input measured 22 % off on AVX2).
_INPUT_ERROR = {"int8": 2e-2, "int4": 2e-2, "w8a8": 8e-2, "fp16": 1e-4}  # fp16 takes float32 inputs as they are
MODES = ["int8", "int4", "w8a8", "fp16"]


@pytest.mark.parametrize("quantization", MODES)
def test_kernel_output_is_the_dequantized_weight_times_the_input(quantization: str) -> None:
    weight, bias = _weight(300, 128), torch.randn(300)
    projection = QuantizedProjection(weight, bias, quantization)  # type: ignore[arg-type]
    x = torch.randn(5, 128)
    dequantized = projection.dequantized_rows(torch.arange(300))
    inputs = x if quantization in ("w8a8", "fp16") else x.to(torch.bfloat16).float()
    expected = inputs @ dequantized.T + bias
    # The weight-only kernels accumulate in their own order and round the output to bfloat16 before widening it.
    torch.testing.assert_close(projection(x), expected, rtol=1e-2, atol=_INPUT_ERROR[quantization])
    assert projection(x).dtype == torch.float32 and projection(x[None]).shape == (1, 5, 300)


@pytest.mark.parametrize(
    ("quantization", "tolerance"), [("int8", 0.01), ("int4", 0.12), ("w8a8", 0.01), ("fp16", 0.001)]
)
def test_quantized_weights_stay_close_to_the_original(quantization: str, tolerance: float) -> None:
    weight = _weight(256, 256, seed=1)
    projection = QuantizedProjection(weight, None, quantization)  # type: ignore[arg-type]
    error = (projection.dequantized_rows(torch.arange(256)) - weight).norm() / weight.norm()
    assert error < tolerance, error  # int8 per channel: ~0.5 %; int4 in groups of 32: ~8 % on Gaussian weights
    # Codes, plus a bfloat16 scale per output (int8) or a scale and offset per 32 weights (int4: 5 bits a weight).
    expected = {
        "int8": 256 * 256 + 256 * 2,
        "w8a8": 256 * 256 + 256 * 4,  # float32 scales, as fbgemm takes them
        "int4": 256 * 256 // 2 + 256 * 256 // INT4_GROUP * 4,
        "fp16": 256 * 256 * 2,
    }[quantization]
    assert projection.weight_bytes == expected


def test_int4_keeps_each_group_s_extremes_exactly() -> None:
    """The grid of a group spans its minimum and maximum, so weights already on a 4-bit grid (a GGUF Q4
    sub-block dequantized) come back as they were, up to the bfloat16 scale."""
    codes = torch.randint(0, 16, (64, 128), generator=torch.Generator().manual_seed(2)).float()
    codes[:, ::INT4_GROUP] = 0
    codes[:, 1::INT4_GROUP] = 15
    scale = torch.rand(64, 128 // INT4_GROUP, generator=torch.Generator().manual_seed(3)) / 100 + 0.01
    scale = scale.to(torch.bfloat16).float()  # representable scales, as the kernel keeps them
    low = -8 * scale
    weight = (codes.view(64, -1, INT4_GROUP) * scale[..., None] + low[..., None]).view(64, 128)
    projection = QuantizedProjection(weight, None, "int4")
    torch.testing.assert_close(projection.dequantized_rows(torch.arange(64)), weight, rtol=0, atol=1e-6)


@pytest.mark.parametrize("quantization", MODES)
def test_select_gives_the_logits_the_full_projection_gives(quantization: str) -> None:
    projection = QuantizedProjection(_weight(500, 64), None, quantization)  # type: ignore[arg-type]
    x = torch.randn(3, 64)
    rows, columns = torch.tensor([0, 0, 2, 1]), torch.tensor([7, 499, 0, 250])
    full = projection(x)
    error = _INPUT_ERROR[quantization] / 2  # w8a8's select reads the input unrounded
    torch.testing.assert_close(projection.select(x, rows, columns), full[rows, columns], rtol=1e-2, atol=error)


@pytest.mark.parametrize("quantization", MODES)
def test_a_quantized_split_head_equals_its_parts_and_selects_across_them(one_thread: None, quantization: str) -> None:
    weight = _weight(9_001, 64, seed=4)
    split = SplitProjection(weight, keep_plain=True, quantization=quantization)  # type: ignore[arg-type]
    assert all(isinstance(part, QuantizedProjection) for part in split.parts)
    x = torch.randn(4, 64)
    out = split(x)
    for part, (lo, hi) in zip(split.parts, split.bounds, strict=True):
        assert torch.equal(out[:, lo:hi], part(x))
    rows, columns = torch.tensor([0, 3, 1, 2]), torch.tensor([0, 4_500, 4_501, 9_000])
    error = _INPUT_ERROR[quantization] / 2
    torch.testing.assert_close(split.select(x, rows, columns), out[rows, columns], rtol=1e-2, atol=error)


def test_int4_keeps_an_int8_head_and_w8a8_int8_layers() -> None:
    modes = ("none", "int8", "int4", "w8a8", "fp16")
    assert [head_quantization(q) for q in modes] == ["none", "int8", "int8", "w8a8", "fp16"]
    assert [layer_quantization(q) for q in modes] == ["none", "int8", "int4", "int8", "fp16"]


def test_fp16_is_the_half_precision_weight_in_a_float32_product_and_a_layer_keeps_no_float_copy() -> None:
    weight = _weight(300, 128, seed=5)
    projection = QuantizedProjection(weight, None, "fp16")
    x = torch.randn(4, 128)
    torch.testing.assert_close(projection(x), x @ weight.half().float().T, rtol=0, atol=1e-5)
    assert not projection.rounds_outputs  # float32 out: no logit refinement needed
    layer = QuantizedProjection(weight, None, "fp16", keep_rows=False)
    assert torch.equal(layer(x), projection(x))
    with pytest.raises(ValueError, match="kept no rows"):
        layer.dequantized_rows(torch.tensor([0]))


def test_what_cannot_be_quantized_stays_a_plain_projection() -> None:
    assert not quantizable(torch.randn(8, 40), "int4")  # 40 inputs: not whole groups of 32
    assert quantizable(torch.randn(8, 40), "int8")
    assert not quantizable(torch.randn(8, 64), "none")
    assert not quantizable(torch.randint(0, 3, (8, 64)), "int8")
    with pytest.raises(ValueError, match="cannot quantize"):
        QuantizedProjection(torch.randn(8, 40), None, "int4")
    assert isinstance(head_projection(torch.randn(512, 64), "int4"), QuantizedProjection)
    assert not isinstance(head_projection(torch.randn(512, 40), "int4"), QuantizedProjection)


def test_a_very_large_head_shares_even_a_single_row(one_thread: None, monkeypatch: pytest.MonkeyPatch) -> None:
    weight = torch.randn(5_000, 64)
    small = SplitProjection(weight)
    assert not small.shares_work(1) and small.shares_work(2) == ((os.cpu_count() or 1) >= 2)
    monkeypatch.setattr(split_projection, "SHARE_SINGLE_ROW_MIN_ELEMENTS", 5_000 * 64)  # as Gemma 3's head
    large = SplitProjection(weight)
    assert large.shares_work(1) == ((os.cpu_count() or 1) >= 2)
    x = torch.randn(1, 64)
    assert torch.equal(large(x), small(x))
