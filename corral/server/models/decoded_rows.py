"""Decoded rows of a quantized head, kept for the next step.

Every step recomputes a few logits exactly from the head's decoded rows (corral/kernels/logit_refinement.py) and
a grammar-restricted row computes all of its allowed ones so. Decoding a row from its blocks goes through the
`gguf` package's numpy decoders: 0.2-0.4 ms a call for a handful of rows (Gemma 3's Q8_0 and Qwen2.5's Q6_K
heads on an AMD EPYC), ~1 % of Gemma 3 270M's step, every step. The same tokens come back step after step (a
text's common words, a grammar's keys), so the rows are kept, least recently used out first, within a byte
budget.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import numpy as np

ROW_CACHE_BYTES = 16 << 20  # Qwen2.5 1.5B's rows are 6 KiB in float32: ~2,700 of them


class DecodedRows:
    """Rows of one weight decoded to float32 by `decode` (row ids → [len(ids), width]), the recent ones kept."""

    def __init__(self, decode: Callable[[np.ndarray], np.ndarray], width: int, budget: int = ROW_CACHE_BYTES) -> None:
        self._decode = decode
        self._kept: OrderedDict[int, np.ndarray] = OrderedDict()
        self.width = width
        self.capacity = max(1, budget // (4 * width))

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        """The rows `ids` (distinct), in their order."""
        kept = self._kept
        missing = [int(i) for i in ids if int(i) not in kept]
        if missing:
            for row_id, row in zip(missing, self._decode(np.asarray(missing)), strict=True):
                kept[row_id] = row
        rows = []
        for i in ids:
            kept.move_to_end(int(i))
            rows.append(kept[int(i)])
        while len(kept) > self.capacity:
            kept.popitem(last=False)
        return np.stack(rows) if rows else np.empty((0, self.width), dtype=np.float32)
