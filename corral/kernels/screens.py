"""Which screen, if any, serves a step's rows that need only their best token (corral/kernels/head_screen.py).

One screened row takes ggml's block screen (corral/kernels/block_screen.py): the fewest bytes through the
fastest one-row kernel, with tight bounds. Several take fbgemm's integer screen (`HeadScreen`), which reads each
weight once for all of them, where its 8-bit sums are exact; elsewhere they keep the fp16 head.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from corral.kernels.block_screen import BlockScreen, block_screen_available
from corral.kernels.head_screen import HeadScreen, Screen, calibrated_screen


@dataclass(frozen=True)
class HeadScreens:
    one_row: BlockScreen | None
    several_rows: HeadScreen | None

    def for_rows(self, count: int) -> Screen | None:
        """The screen for a step with `count` screened rows."""
        if count == 1 and self.one_row is not None:
            return self.one_row
        return self.several_rows

    @property
    def one_row_bytes(self) -> int | None:
        """Bytes the head reads for a step of one screened row (None: the fp16 head's)."""
        screen = self.for_rows(1)
        return None if screen is None else screen.weight_bytes


def head_screens(
    weight: torch.Tensor, hidden_of: Callable[[torch.Tensor, Any], torch.Tensor], scale: float | None
) -> HeadScreens:
    """The screens of the fp16 head `weight` [vocab, in_features]; `hidden_of` and `scale` calibrate
    fbgemm's (`calibrated_screen`)."""
    vocab, width = (int(d) for d in weight.shape)
    one_row = BlockScreen(weight) if block_screen_available(width) else None
    return HeadScreens(one_row, calibrated_screen(weight, vocab, hidden_of, scale))
