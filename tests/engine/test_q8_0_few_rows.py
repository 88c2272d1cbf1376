"""A Q8_0 head's products of a few rows by either of ggml's routes (llamafile's tiles, its own dot products over
input rows laid one block apart), the faster per row count from the first calls (corral/kernels/timed_choice.py):
the same logits whichever serves."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from gguf_models import write_small_gguf

from corral.kernels.block_screen import ggml_q8_0_blocks, q8_0_blocks
from corral.kernels.row_kernel import QuantBlocks, RowKernel, layer_graphs_available, llamafile_built
from corral.kernels.timed_choice import TRIALS, TimedChoice
from corral.server.models.gguf_decoder import DOT_ROWS_MAX, load_gguf_decoder

pytestmark = pytest.mark.skipif(
    not layer_graphs_available(),
    reason="ggml is off: the ggml extra is not installed (pip install -e '.[ggml]') or CORRAL_ROW_KERNEL says so",
)

Q8_0 = 8


def _weight(vocab: int = 1024, width: int = 128) -> QuantBlocks:
    values = torch.randn(vocab, width, generator=torch.Generator().manual_seed(0)) * 0.05
    raw, _ = q8_0_blocks(values)
    return QuantBlocks(raw.numpy(), Q8_0, "q8_0", vocab, width)


def test_the_dot_products_over_ggmls_own_rounding_give_the_tiles_logits() -> None:
    """Handed the input as ggml's quantizer rounds it (a few large dimensions among small ones, as Gemma's hidden
    states have), the dot products give what the float input gives through the tiles."""
    weight = _weight()
    tiles, dots = RowKernel(weight, max_rows=8), RowKernel(weight, max_rows=8, input_blocks=True, dot_products=True)
    for rows in (1, 2, 5, 8):
        x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)) * 3
        x[:, 5] = 70.0
        x[0, 40:72] = 0.0  # a block of zeros: no step, no codes
        ours, theirs = dots(ggml_q8_0_blocks(x)), tiles(x)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5 * float(theirs.abs().max()))


def test_the_dot_products_take_only_q8_0_blocks() -> None:
    with pytest.raises(ValueError, match="input_blocks"):
        RowKernel(_weight(), dot_products=True)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_each_row_count_keeps_the_kernel_its_first_calls_timed_faster() -> None:
    clock = _Clock()
    choice = TimedChoice(clock)
    costs = {(3, 0): 1.0, (3, 1): 0.5, (4, 0): 1.0, (4, 1): 0.95, (5, 0): 0.4, (5, 1): 1.0}

    def kernel(rows: int, which: int) -> torch.Tensor:
        clock.now += costs[rows, which]
        return torch.tensor([which])

    for rows in (3, 4, 5):
        served = [int(choice.run(rows, lambda r=rows: kernel(r, 0), lambda r=rows: kernel(r, 1))) for _ in range(12)]
        assert sorted(served[: 2 * (TRIALS + 1)]) == [0] * (TRIALS + 1) + [1] * (TRIALS + 1)  # both tried
        assert choice.chosen(rows) is not None
        assert set(served[2 * (TRIALS + 1) :]) == {choice.chosen(rows)}
    assert (choice.chosen(3), choice.chosen(4), choice.chosen(5)) == (1, 0, 0)  # 4: inside the margin


@pytest.mark.skipif(not llamafile_built(), reason="ggml is built without llamafile's tiles: one route only")
def test_a_gguf_head_serves_the_same_logits_while_it_tries_both_routes(tmp_path: Path) -> None:
    """Gemma 3's head is its Q8_0 embedding: rows of 1 to 16 through the head give the tiles' logits on every
    call, the trial calls included, and every row count of 2 to 16 comes to a choice."""
    path = tmp_path / "gemma3.gguf"
    reference = write_small_gguf(path, "gemma3")
    decoder = load_gguf_decoder(path, reference.config, "gemma3")
    head = decoder.head
    tiles = RowKernel(decoder.file.weight("token_embd.weight"), max_rows=16)
    for rows, _ in itertools.product((1, 2, 3, 7, 16), range(2 * TRIALS + 3)):
        x = torch.randn(rows, head.in_features, generator=torch.Generator().manual_seed(rows)) * 4
        with torch.inference_mode():  # as the engine runs it (the load's probe built some of the kernels' inputs so)
            torch.testing.assert_close(head(x), tiles(x), rtol=1e-5, atol=1e-5)
    assert all(head.choice.chosen(rows) is not None for rows in (2, 3, 7, 16))
    assert head.choice.chosen(1) is None  # one row: ggml's own product of one row, no choice


@pytest.mark.skipif(not llamafile_built(), reason="ggml is built without llamafile's tiles: one route only")
def test_a_free_text_step_of_few_rows_keeps_its_head_out_of_the_graph_until_the_tiles_win(tmp_path: Path) -> None:
    """The head inside the decoder's graph multiplies by the tiles: a step of 2-16 rows wanting every logit runs
    it there only once that row count's trials chose the tiles; one row always does."""
    path = tmp_path / "gemma3.gguf"
    reference = write_small_gguf(path, "gemma3")
    decoder = load_gguf_decoder(path, reference.config, "gemma3")
    head = decoder.head
    assert decoder.head_in_graph(1) and decoder.head_in_graph(DOT_ROWS_MAX + 1)
    assert not decoder.head_in_graph(3)  # not tried yet
    x = torch.randn(3, head.in_features, generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        while head.choice.chosen(3) is None:
            head(x)
    assert decoder.head_in_graph(3) == (head.choice.chosen(3) == 0)
