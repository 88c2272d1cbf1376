"""The quantized head's decoded rows, kept between steps (corral/server/models/decoded_rows.py)."""

from __future__ import annotations

import numpy as np

from corral.server.models.decoded_rows import DecodedRows


def test_rows_come_back_as_decoded_each_decoded_once_while_kept_the_oldest_out_first() -> None:
    weight = np.random.default_rng(0).standard_normal((100, 8)).astype(np.float32)
    calls: list[list[int]] = []

    def decode(ids: np.ndarray) -> np.ndarray:
        calls.append([int(i) for i in ids])
        return weight[ids]

    rows = DecodedRows(decode, width=8, budget=3 * 4 * 8)  # room for three rows
    assert rows.capacity == 3
    np.testing.assert_array_equal(rows(np.array([5, 2])), weight[[5, 2]])
    np.testing.assert_array_equal(rows(np.array([2, 7, 5])), weight[[2, 7, 5]])
    assert calls == [[5, 2], [7]]
    rows(np.array([9]))  # used in the order 2, 7, 5: 2 is the oldest and goes
    np.testing.assert_array_equal(rows(np.array([5, 7])), weight[[5, 7]])
    assert calls == [[5, 2], [7], [9]]
    rows(np.array([2]))
    assert calls[-1] == [2]  # it was the one let go
    assert rows(np.array([], dtype=np.int64)).shape == (0, 8)
