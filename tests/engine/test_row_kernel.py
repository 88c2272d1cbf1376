"""fp16 products of a few rows through ggml (corral/kernels/row_kernel.py): the same product as fbgemm's within
the fp16 rounding of the input, for up to four rows in a layer and one in the head, off where the switch says
torch."""

from __future__ import annotations

import pytest
import torch

from corral.kernels.choice import KernelOptions, use_kernels
from corral.kernels.quantized_projection import QuantizedProjection
from corral.kernels.row_kernel import LAYER_MAX_ROWS, RowKernel, llamafile_built, row_kernel_available
from corral.kernels.split_projection import SplitProjection

pytestmark = pytest.mark.skipif(
    not row_kernel_available(),
    reason="ggml is off: the ggml extra is not installed (pip install -e '.[ggml]')",
)


def _weight(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    return torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)) * 0.05


def _close_to_fp16_product(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """ggml's F16 dot product takes fp16 weights and its input rounded to fp16: within that rounding of the
    float32-input product (a wrong layout or a stale input would be off by the outputs' own size, ~0.5)."""
    torch.testing.assert_close(out, x @ weight.half().float().T, rtol=1e-2, atol=3e-3)


def test_a_row_is_the_fp16_product_of_its_fp16_input() -> None:
    weight = _weight(1536, 640, seed=1)
    x = torch.randn(1, 640)
    out = RowKernel(weight)(x)
    assert out.shape == (1, 1536) and out.dtype == torch.float32
    _close_to_fp16_product(out, x, weight)


def test_make_install_builds_ggml_with_llamafiles_tiles() -> None:
    """The Makefile builds the ggml extra with llamafile's tinyBLAS (the package's own build leaves it off), so
    steps of several rows get its tiles: a venv built before that, or a wheel from pip's cache, fails here."""
    assert llamafile_built(), "ggml lacks llamafile's tinyBLAS: rebuild it with `make install` (see the Makefile)"


def test_several_rows_are_the_fp16_product_on_llamafiles_tiles() -> None:
    """8 and 16 rows go through tinyBLAS's tiles (one row through ggml's dot product): the same product."""
    weight = _weight(2048, 640, seed=7)
    kernel = RowKernel(weight, max_rows=16)
    for rows in (1, 3, 8, 16):
        x = torch.randn(rows, 640, generator=torch.Generator().manual_seed(rows))
        _close_to_fp16_product(kernel(x), x, weight)


def test_each_call_reads_its_own_input_and_returns_its_own_output() -> None:
    kernel = RowKernel(_weight(64, 32, seed=2))
    a, b = torch.randn(1, 32), torch.randn(1, 32)
    first = kernel(a)
    second = kernel(b)
    assert not torch.equal(first, second)
    assert torch.equal(kernel(a), first)  # the returned tensor is a copy: the next call did not overwrite it


def test_a_layer_projection_sends_up_to_four_rows_to_ggml_and_more_to_fbgemm() -> None:
    weight = _weight(300, 128, seed=3)
    fbgemm = QuantizedProjection(weight, None, "fp16", keep_rows=False)
    routed = QuantizedProjection(weight, None, "fp16", keep_rows=False, row_kernel=True)
    many = torch.randn(LAYER_MAX_ROWS + 1, 128)
    assert torch.equal(routed(many), fbgemm(many))  # past the limit: fbgemm's kernel, bit for bit
    for rows in range(1, LAYER_MAX_ROWS + 1):
        few = many[:rows]
        out = routed(few)
        _close_to_fp16_product(out, few, weight)
        assert not torch.equal(out, fbgemm(few))  # ggml's product (its input rounded to fp16), not fbgemm's
    assert routed.rounds_outputs and not fbgemm.rounds_outputs  # the head's picks get refined exactly


def test_a_kernel_refuses_more_rows_than_it_was_built_for() -> None:
    kernel = RowKernel(_weight(16, 32, seed=6), max_rows=2)
    assert kernel.takes(1) and kernel.takes(2) and not kernel.takes(3)
    with pytest.raises(ValueError, match="1 to 2 rows"):
        kernel(torch.randn(3, 32))


def test_the_head_takes_one_row_through_ggml_in_one_call() -> None:
    weight = _weight(5000, 64, seed=4)
    head = SplitProjection(weight, keep_plain=True, quantization="fp16")
    one = torch.randn(1, 64)
    _close_to_fp16_product(head(one), one, weight)
    assert head.rounds_outputs  # ggml's: the picks get refined
    rows = torch.randn(2, 64)  # the head sends one row only: two are fbgemm's float32-input product
    torch.testing.assert_close(head(rows), rows @ weight.half().float().T, rtol=0, atol=1e-5)
    assert not head.rounds_outputs  # fbgemm's are exact: no refinement pass over the rows
    # `select` stays the exact float32-input value the refinement writes back.
    exact = head.select(one, torch.tensor([0, 0]), torch.tensor([7, 4999]))
    torch.testing.assert_close(exact, (one @ weight.half().float().T)[0, [7, 4999]], rtol=0, atol=1e-5)


def test_the_switch_turns_it_off() -> None:
    use_kernels(KernelOptions(row_kernel="torch"))  # --row-kernel torch (tests/conftest.py restores the default)
    assert not row_kernel_available()
    weight = _weight(300, 128, seed=5)
    projection = QuantizedProjection(weight, None, "fp16", keep_rows=False, row_kernel=True)
    one = torch.randn(1, 128)
    assert not projection.rounds_outputs
    torch.testing.assert_close(projection(one), one @ weight.half().float().T, rtol=0, atol=1e-5)
