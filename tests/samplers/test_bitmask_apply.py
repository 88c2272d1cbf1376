"""corral's CPU bitmask application gives exactly what xgrammar's kernel gives, for every kind of mask."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xgrammar

from corral.grammar_engines.bitmask import allowed_ids, apply_bitmask, sparse_limit, unpack_rows
from corral.grammar_engines.protocol import allocate_bitmask

VOCAB = 5_003  # not a multiple of 32: the last word is partly past the vocabulary


def _mask(rows: int, densities: list[float], seed: int) -> torch.Tensor:
    """int32 bitmask rows with each token allowed with its row's probability."""
    generator = torch.Generator().manual_seed(seed)
    words = (VOCAB + 31) // 32
    bits = torch.rand(rows, words * 32, generator=generator) < torch.tensor(densities)[:, None]
    packed = (bits.view(rows, words, 32).long() << torch.arange(32)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


# few allowed (inside JSON structure), none, one, all, nearly all (inside a string), half (the worst case for
# xgrammar's kernel), and two between (a regex's character class): each of apply_bitmask's three ways
DENSITIES = [0.001, 0.0, 1 / VOCAB, 1.0, 0.999, 0.5, 0.97, 0.3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [None, [0, 2, 3, 5, 6], [7, 4], []])
def test_matches_xgrammars_kernel(dtype: torch.dtype, rows: list[int] | None) -> None:
    mask = _mask(len(DENSITIES), DENSITIES, seed=1)
    logits = torch.randn(len(DENSITIES), VOCAB + 7, generator=torch.Generator().manual_seed(2)).to(dtype)
    expected = logits.clone()
    xgrammar.apply_token_bitmask_inplace(expected, mask, indices=None if rows is None else rows)
    got = logits.clone()
    apply_bitmask(got, mask, rows)
    assert torch.equal(got, expected)
    # The columns past the mask's 32 × words are left alone, as xgrammar leaves them.
    assert torch.equal(got[:, mask.shape[1] * 32 :], logits[:, mask.shape[1] * 32 :])


def test_a_sparse_row_keeps_exactly_its_allowed_tokens() -> None:
    mask = allocate_bitmask(1, VOCAB)
    mask.zero_()
    words = mask.numpy().view(np.uint32)  # bit 31 is the int32 sign bit
    for token in (0, 31, 32, 4_999, VOCAB - 1):
        words[0, token // 32] |= np.uint32(1 << (token % 32))
    assert allowed_ids(mask[0].numpy(), VOCAB).tolist() == [0, 31, 32, 4_999, VOCAB - 1]
    logits = torch.randn(1, VOCAB)
    original = logits.clone()
    apply_bitmask(logits, mask)
    finite = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert finite == [0, 31, 32, 4_999, VOCAB - 1]
    assert torch.equal(logits[0, finite], original[0, finite])


def test_unpack_rows_names_the_rows_that_allow_at_most_the_limit() -> None:
    mask = _mask(4, [0.001, 0.999, 0.0, 0.02], seed=3)
    counts = [len(allowed_ids(mask[row].numpy(), VOCAB)) for row in range(4)]
    counted, found = unpack_rows(mask, [0, 1, 2, 3], VOCAB, counts[3])
    assert sorted(found) == [0, 2, 3]  # the wide row is left out (it is never unpacked)
    assert found[2].tolist() == [] and found[0].tolist() == allowed_ids(mask[0].numpy(), VOCAB).tolist()
    assert [counted[row] for row in (0, 2, 3)] == [counts[0], 0, counts[3]]
    assert sorted(unpack_rows(mask, [0, 3], VOCAB, counts[3] - 1)[1]) == [0]
    assert unpack_rows(mask, [1], VOCAB, sparse_limit(VOCAB))[1] == {}  # the head's limit: vocab / 16
