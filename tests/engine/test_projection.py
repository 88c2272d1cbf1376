"""The oneDNN-packed projection computes what F.linear computes, row by row whatever the batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from corral.kernels import projection
from corral.kernels.projection import Projection

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")


def _weights(out_features: int, in_features: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(out_features * 31 + in_features)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    return weight, torch.randn(out_features, generator=generator).to(dtype)


@needs_onednn
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("rows", [0, 1, 2, 7, 33])
def test_packed_projection_equals_f_linear(dtype: torch.dtype, tolerance: float, rows: int) -> None:
    weight, bias = _weights(640, 512, dtype)
    proj = Projection(weight, bias)
    # A 640 x 512 weight is above the packing threshold; oneDNN packs bfloat16 only on CPUs with the
    # instructions for it (AVX-512 BW/VL/DQ or AVX-NE-CONVERT), elsewhere the plain path must still be right.
    packable = dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert proj.packed == packable
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(dtype)
    got = proj(x)
    assert got.shape == (rows, 640) and got.dtype == dtype
    torch.testing.assert_close(got.float(), F.linear(x, weight, bias).float(), rtol=tolerance, atol=tolerance)


@needs_onednn
def test_a_packed_row_does_not_depend_on_the_rest_of_the_batch() -> None:
    """A request's logits must not change with what else shares its step."""
    weight, _ = _weights(4096, 512, torch.float32)
    proj = Projection(weight)
    batch = torch.randn(16, 512, generator=torch.Generator().manual_seed(3))
    whole = proj(batch)
    for rows in (2, 5, 8):
        assert torch.equal(proj(batch[:rows]), whole[:rows])


@needs_onednn
def test_a_long_input_axis_keeps_only_the_packed_weight() -> None:
    """Packing must not double the model's memory: past the short-input single-row case the plain copy goes."""
    wide, _ = _weights(1024, 512, torch.float32)
    short, _ = _weights(8192, 64, torch.float32)  # the default model's head shape: single rows stay plain
    assert Projection(wide).holds_plain is False
    assert Projection(short).holds_plain is True
    x = torch.randn(1, 64)
    torch.testing.assert_close(Projection(short)(x), F.linear(x, short))


def test_small_weights_and_missing_onednn_use_f_linear_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    small, small_bias = _weights(96, 64, torch.float32)
    assert small.numel() < projection.PACK_MIN_ELEMENTS
    proj = Projection(small, small_bias)
    assert not proj.packed
    x = torch.randn(5, 64)
    assert torch.equal(proj(x), F.linear(x, small, small_bias))
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    large, _ = _weights(1024, 512, torch.float32)
    fallback = Projection(large)
    assert not fallback.packed and fallback.holds_plain
    y = torch.randn(3, 512)
    assert torch.equal(fallback(y), F.linear(y, large))


@pytest.mark.parametrize("keep_plain", [False, True])
def test_select_computes_the_chosen_outputs_only(keep_plain: bool) -> None:
    """The grammar-restricted head: (row, column) pairs of the product, with the bias."""
    weight, bias = _weights(4096, 64, torch.float32)
    proj = Projection(weight, bias, keep_plain=keep_plain)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4))
    rows = torch.tensor([0, 0, 2, 1, 2])
    columns = torch.tensor([5, 4095, 0, 17, 17])
    full = F.linear(x, weight, bias)
    torch.testing.assert_close(proj.select(x, rows, columns), full[rows, columns], rtol=1e-5, atol=1e-5)
    assert proj.select(x, rows[:0], columns[:0]).shape == (0,)


@needs_onednn
def test_keep_plain_keeps_a_packed_weight_selectable() -> None:
    wide, _ = _weights(1024, 512, torch.float32)
    proj = Projection(wide, keep_plain=True)
    assert proj.packed and proj.holds_plain and proj.uses_packed(1)
    x = torch.randn(2, 512)
    torch.testing.assert_close(proj.select(x, torch.tensor([1]), torch.tensor([7])), F.linear(x, wide)[1, 7:8])
