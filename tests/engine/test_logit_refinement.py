"""Rounded logits made exact where they decide the step: a bfloat16 tie between two tokens is broken by the
model's own values, not by token id, so a full row and a grammar-restricted row pick the same token."""

from __future__ import annotations

import torch

from corral.kernels.logit_refinement import REFINE_MAX_PER_ROW, REFINE_RELATIVE_MARGIN, near_top, refine_near_top
from corral.kernels.quantized_projection import QuantizedProjection


def test_near_top_names_each_row_s_finite_logits_within_rounding_distance_of_its_best() -> None:
    logits = torch.full((3, 10), -5.0)
    logits[0, [2, 7]] = torch.tensor([8.0, 8.0 * (1 - REFINE_RELATIVE_MARGIN / 2)])  # within the margin
    logits[0, 4] = 8.0 * (1 - 2 * REFINE_RELATIVE_MARGIN)  # outside it
    logits[1, :] = float("-inf")
    logits[1, 3] = -2.0  # negative best: the margin is measured from its size
    logits[1, 5] = -2.0 * (1 + REFINE_RELATIVE_MARGIN / 2)
    logits[2, 0] = 1.0  # row 2 is not asked for
    rows, columns = near_top(logits, [0, 1])
    assert sorted(zip(rows.tolist(), columns.tolist(), strict=True)) == [(0, 2), (0, 7), (1, 3), (1, 5)]
    assert near_top(logits, [])[1].numel() == 0


def test_a_flat_row_refines_at_most_its_best_few() -> None:
    logits = torch.full((1, 1000), 5.0)
    logits[0, 999] = 5.001
    columns = near_top(logits, [0])[1]
    assert len(columns) == 1 + REFINE_MAX_PER_ROW and 999 in columns.tolist()


def _tied_head() -> QuantizedProjection:
    """Two outputs whose exact values differ by less than bfloat16 keeps at their size."""
    weight = torch.full((4, 32), 0.3)
    weight[0, -1] = 0.29  # output 0 is the smaller, by ~0.01 of ~9.6 (a bfloat16 step there is 0.0625)
    weight[2:] = -0.1
    return QuantizedProjection(weight, None, "int8")


def test_refinement_breaks_a_rounding_tie_by_the_exact_values() -> None:
    head = _tied_head()
    hidden = torch.ones(1, 32)
    logits = head(hidden)
    assert logits[0, 0] == logits[0, 1] and int(logits.argmax()) == 0, "the kernel should round the two to a tie"
    refine_near_top(head, logits, hidden, [0])
    exact = head.select(hidden, torch.zeros(2, dtype=torch.long), torch.tensor([0, 1]))
    assert torch.equal(logits[0, :2], exact) and int(logits.argmax()) == 1
    restricted = head.select(hidden, torch.zeros(4, dtype=torch.long), torch.arange(4))
    assert int(restricted.argmax()) == int(logits.argmax())  # what a grammar-restricted row would pick


def test_masked_logits_stay_masked_and_unasked_rows_untouched() -> None:
    head = _tied_head()
    hidden = torch.ones(2, 32)
    logits = head(hidden)
    logits[0, 1] = float("-inf")  # the grammar forbids the exact best
    before = logits.clone()
    refine_near_top(head, logits, hidden, [0])
    assert torch.isneginf(logits[0, 1]) and int(logits[0].argmax()) == 0
    assert torch.equal(logits[1], before[1])


def test_a_head_that_does_not_round_is_left_alone() -> None:
    head = QuantizedProjection(torch.full((4, 32), 0.3), None, "w8a8")  # fbgemm returns float32
    hidden = torch.ones(1, 32)
    logits = head(hidden)
    before = logits.clone()
    refine_near_top(head, logits, hidden, [0])
    assert not head.rounds_outputs and torch.equal(logits, before)


def test_a_row_reporting_top_logprobs_refines_down_to_its_last_alternative() -> None:
    logits = torch.tensor([[9.0, 7.0, 5.0, 5.0 * (1 - REFINE_RELATIVE_MARGIN / 2), 1.0]])
    assert near_top(logits, [0])[1].tolist() == [0]
    assert sorted(near_top(logits, [0], [3])[1].tolist()) == [0, 1, 2, 3]  # the 3rd best's rival too


def test_refinement_names_where_each_row_s_best_lies_except_a_crowded_row() -> None:
    """A greedy pick over the columns it returns is the whole row's argmax (the engine picks over them instead of
    the vocabulary); a flat row, refined only in part, is not named."""
    head = _tied_head()
    hidden = torch.ones(1, 32)
    logits = head(hidden)
    among = refine_near_top(head, logits, hidden, [0])
    assert list(among) == [0] and among[0].tolist() == [0, 1]
    assert int(among[0][logits[0, among[0]].argmax()]) == int(logits[0].argmax()) == 1
    wide = QuantizedProjection(torch.full((2 * REFINE_MAX_PER_ROW, 32), 0.3), None, "int8")  # every output ties
    flat = wide(hidden)
    assert refine_near_top(wide, flat, hidden, [0]) == {}
    assert refine_near_top(QuantizedProjection(torch.full((4, 32), 0.3), None, "w8a8"), flat, hidden, [0]) == {}


def _reference_near_top(logits: torch.Tensor, rows: list[int], depths: list[int]) -> list[tuple[int, int]]:
    """near_top's contract, one row at a time in plain Python."""
    found = []
    for row, depth in zip(rows, depths, strict=True):
        values = logits[row].tolist()
        ranked = sorted((v for v in values if v != float("-inf")), reverse=True)
        if not ranked:
            continue
        edge = ranked[min(depth, len(ranked)) - 1]
        floor = edge - abs(edge) * REFINE_RELATIVE_MARGIN
        columns = [c for c, v in enumerate(values) if v >= floor]
        if len(columns) > depth + REFINE_MAX_PER_ROW:
            columns = sorted(sorted(columns, key=lambda c: -values[c])[: depth + REFINE_MAX_PER_ROW])
        found += [(row, c) for c in columns]
    return found


def test_the_search_finds_every_candidate_across_chunks_and_the_tail_in_row_order() -> None:
    """Rows wider than a search chunk: candidates in several chunks and past the last whole one, a masked row,
    a row reporting alternatives and a flat row, searched alone and together."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 3 * 1024 + 300, generator=generator) * 3
    logits[0, [10, 2000, 3 * 1024 + 5]] = torch.tensor([20.0, 20.0 * (1 - REFINE_RELATIVE_MARGIN / 3), 19.99])
    logits[1] = float("-inf")
    logits[1, 2500] = -1.0
    logits[2, 3 * 1024 + 299] = 30.0  # the best in the tail alone
    logits[3, :200] = 25.0  # flat: more ties than a row refines
    logits[4, ::2] = float("-inf")
    for rows, depths in (([0, 1, 2, 3, 4], [1, 1, 1, 1, 1]), ([4, 0, 2], [3, 1, 2]), ([2], [1]), ([3], [1])):
        index, columns = near_top(logits, rows, depths)
        assert list(zip(index.tolist(), columns.tolist(), strict=True)) == _reference_near_top(logits, rows, depths)
