"""From how many rows a GGUF's repacked weights are multiplied by the file's own blocks instead: measured at load.

ggml multiplies a repacked weight (corral/server/models/gguf_file.py, `repack`) in its interleaved GEMM/GEMV
kernels, and the file's own K-quant blocks, for products of 8 rows and more, in its tiled kernels, which lay the
weight out afresh per product and then multiply many rows cheaply. Which is faster depends on the CPU and the
rows: on an AMD EPYC (AVX2, 2 threads) Qwen2.5-Coder 1.5B's ffn_gate took 0.15 ms repacked against 0.18 for one
row, 0.91 against 0.74 for 16 and 28.4 against 15.5 for 512, and its 512-token prompt ran at 179 tok/s repacked
against 309 from the blocks (docs/measured-choices.md#wide-products). So the largest repacked weight is timed
both ways at a few row counts when the decoder first loads on a CPU and ggml build (a few tenths of a second; the
choice is kept in the cache, `wide-rows/`, so a restart serves the same products), and products from the first
count where the blocks win there and at every larger count take the blocks; where they never win, the file's
pages of the repacked weights are released and the memory stays one copy's worth.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import cast

import torch

from corral.kernels.row_kernel import RowKernel
from corral.server.models.gguf_file import GgufFile, MappedWeight
from corral.server.models.repack_verdicts import keep, keyed_path, read_kept

log = logging.getLogger(__name__)

ROWS_TRIED = (8, 16, 32, 64, 128)
WIDE_VERSION = 1  # raised when the timing or its rule changes, so older choices are not read
FOLDER = "wide-rows"
BATCHES = 5
BATCH_SECONDS = 0.004  # a batch repeats the product for at least this long: small weights' products take ~0.1 ms
# The blocks must be this much faster to be chosen: a shared CPU's noise must not flip a step's weights.
MARGIN = 0.9


def _best_ms(kernel: RowKernel, rows: int, in_features: int) -> float:
    """The product's time, the mean over a batch of repeats, the best of BATCHES batches."""
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    start = time.perf_counter()
    kernel(x)  # the first product of a shape pays for its plan and cold caches
    repeats = max(1, int(BATCH_SECONDS / max(time.perf_counter() - start, 1e-6)))
    best = float("inf")
    for _ in range(BATCHES):
        start = time.perf_counter()
        for _ in range(repeats):
            kernel(x)
        best = min(best, (time.perf_counter() - start) / repeats)
    return 1e3 * best


def timed_rows(weight: MappedWeight, rows_tried: tuple[int, ...] = ROWS_TRIED) -> list[tuple[int, float, float]]:
    """(rows, ms repacked, ms from the blocks) for each row count tried."""
    assert weight.blocks is not None
    blocks = dataclasses.replace(weight, ggml_weight=weight.blocks, blocks=None, wide=None)
    repacked_kernel = RowKernel(weight, max_rows=max(rows_tried))
    blocks_kernel = RowKernel(blocks, max_rows=max(rows_tried))
    width = weight.in_features
    return [(rows, _best_ms(repacked_kernel, rows, width), _best_ms(blocks_kernel, rows, width)) for rows in rows_tried]


def wide_start(timings: list[tuple[int, float, float]]) -> int | None:
    """The fewest rows from which the blocks are faster (by MARGIN) at every count timed; None if at none."""
    start = None
    for rows, repacked, blocks in reversed(timings):
        if blocks > MARGIN * repacked:
            break
        start = rows
    return start


def settle_wide_rows(file: GgufFile) -> int | None:
    """Time the file's largest repacked weight and settle, for the whole file, from how many rows products take
    the blocks; returns that count (None: never, and the blocks' pages are released)."""
    names = file.repacked_names()
    if not names:
        return None
    path = keyed_path(file.path, [sorted(names), WIDE_VERSION, list(ROWS_TRIED), MARGIN], FOLDER)
    kept = read_kept(path)
    if kept is not None and (kept.get("start") is None or isinstance(kept.get("start"), int)):
        start = cast(int | None, kept.get("start"))
        file.settle_wide_rows(start)
        log.info("products of %s rows take %s's own blocks (as timed at an earlier load)",
                 f"{start}+" if start is not None else "no", file.path.name)
        return start
    largest = max(names, key=file.nbytes)
    timings = timed_rows(file.weight(largest))
    start = wide_start(timings)
    keep(path, {"start": start, "weight": largest, "timings": timings}, "wide-rows timing")
    file.settle_wide_rows(start)
    log.info("products of %s rows take %s's own blocks, not its repacked weights (%s timed: %s)",
             f"{start}+" if start is not None else "no", file.path.name, largest,
             ", ".join(f"{rows} rows {a:.2f} / {b:.2f} ms" for rows, a, b in timings))
    return start
