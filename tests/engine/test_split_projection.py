"""The head split over the engine thread and a helper computes exactly what one projection computes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from corral.kernels.projection import Projection
from corral.kernels.split_projection import SplitProjection, head_projection


@pytest.fixture
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as the server runs the engine on a 2-core host: the helper takes slices
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features", [64, 512])
def test_split_equals_one_projection(one_thread: None, dtype: torch.dtype, in_features: int) -> None:
    generator = torch.Generator().manual_seed(in_features)
    weight = torch.randn(9_001, in_features, generator=generator).to(dtype)  # odd: unequal slices
    whole, split = Projection(weight, keep_plain=True), SplitProjection(weight, keep_plain=True)
    assert [hi - lo for lo, hi in split.bounds] == [4_501, 4_500]
    for rows in (0, 1, 2, 7, 33):
        x = torch.randn(rows, in_features, generator=generator).to(dtype)
        assert split.shares_work(rows) == (rows > 1)
        assert torch.equal(split(x), whole(x)), rows
    columns, picked = torch.tensor([0, 4_500, 4_501, 9_000]), torch.tensor([1, 0, 1, 0])
    x = torch.randn(2, in_features, generator=generator).to(dtype)
    torch.testing.assert_close(split.select(x, picked, columns), whole.select(x, picked, columns))


def test_with_more_torch_threads_the_slices_run_in_the_calling_thread() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        weight = torch.randn(5_000, 64)
        split = SplitProjection(weight)
        assert not split.shares_work(8)
        x = torch.randn(8, 64)
        assert torch.equal(split(x), Projection(weight)(x))
    finally:
        torch.set_num_threads(before)


def test_an_error_in_a_slice_reaches_the_caller(one_thread: None) -> None:
    split = SplitProjection(torch.randn(5_000, 64))
    with pytest.raises(RuntimeError):
        split(torch.randn(4, 63))  # wrong input width: whichever thread computes the slice fails
    assert split(torch.randn(4, 64)).shape == (4, 5_000)  # and the next call works


def test_only_large_cpu_heads_are_split() -> None:
    assert isinstance(head_projection(torch.randn(128_257, 64)), SplitProjection)
    assert isinstance(head_projection(torch.randn(512, 64)), Projection)


@pytest.mark.parametrize("inference", [True, False])
def test_a_slice_taken_by_another_thread_writes_the_callers_output(inference: bool) -> None:
    """The engine steps under torch.inference_mode, which is per thread: the helper must match it."""
    import threading

    from corral.kernels.split_projection import _Slices

    weight = torch.randn(9_001, 64)  # slices above the packing threshold, like the whole
    split = SplitProjection(weight)
    x = torch.randn(3, 64)
    with torch.inference_mode(inference):
        out = torch.empty(3, 9_001)
        slices = _Slices(split.parts, split.bounds, x, out)
    helper = threading.Thread(target=slices.work)  # takes every slice, as a helper with a free core may
    helper.start()
    helper.join(30)
    assert slices.done.is_set() and slices.error is None
    assert torch.equal(out, Projection(weight)(x))
