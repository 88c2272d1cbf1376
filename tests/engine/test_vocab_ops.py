"""The fast whole-vocabulary operations give the answers of the plain (sorting, scanning) ones."""

from __future__ import annotations

import pytest
import torch

from corral.server.engine.vocab_ops import draw, filter_logits, row_argmax

VOCAB = 128_257  # the default model's vocabulary: not a multiple of the argmax chunk


def _reference_filter(x: torch.Tensor, min_p: float, top_k: int, top_p: float) -> torch.Tensor:
    """min_p → top_k → top_p over a full descending sort (the definition), in float64."""
    x = x.double()
    ordered, order = torch.sort(x, descending=True)
    probs = torch.softmax(ordered, dim=-1)
    drop = probs < min_p * probs[0]
    if top_k > 0:
        drop |= torch.arange(x.shape[0]) >= top_k
    kept = torch.softmax(ordered.masked_fill(drop, float("-inf")), dim=-1)
    drop |= (torch.cumsum(kept, dim=-1) - kept) > top_p
    return x.scatter(0, order, ordered.masked_fill(drop, float("-inf"))).float()


def _logits(seed: int, scale: float) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(VOCAB, generator=generator) * scale


def test_row_argmax_matches_torch_including_the_tail_and_first_of_ties() -> None:
    x = torch.stack([_logits(s, 2.0) for s in range(6)])
    x[1, VOCAB - 3] = 100.0  # maximum in the tail past the last whole chunk
    x[2, 5000] = x[2, 90_000] = 50.0  # a tie: the first wins
    x[3, :] = float("-inf")
    x[4, VOCAB - 1] = x[4, 7] = 60.0  # a tie between the first chunk and the tail
    x[5, 1024 * 3 + 17] = 70.0
    assert row_argmax(x).tolist() == torch.argmax(x, dim=-1).tolist()
    small = torch.tensor([[0.0, 3.0, 3.0, 1.0]])
    assert row_argmax(small).tolist() == [1]


def test_filters_keep_exactly_the_reference_set() -> None:
    cases = [  # (min_p, top_k, top_p) over flat and peaked distributions
        (0.0, -1, 0.9), (0.0, 50, 1.0), (0.05, -1, 1.0), (0.02, 40, 0.8), (0.0, -1, 0.999), (0.0, 5000, 0.95),
    ]
    for scale in (0.5, 6.0):  # flat: long nucleus, full-sort fallback; peaked: cut-offs
        for seed, (min_p, top_k, top_p) in enumerate(cases):
            x = _logits(seed, scale)
            x[::7] = float("-inf")  # a grammar mask
            fast = x.clone()[None, :]
            filter_logits(fast, [min_p], [top_k], [top_p])
            expected = torch.isfinite(_reference_filter(x, min_p, top_k, top_p))
            assert torch.equal(torch.isfinite(fast[0]), expected), (scale, min_p, top_k, top_p)


def test_draw_follows_the_distribution_and_never_takes_a_zero_probability_token() -> None:
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])
    generator = torch.Generator().manual_seed(7)
    n = 20_000
    uniforms = torch.rand(n, generator=generator)
    tokens = draw(probs.expand(n, -1), uniforms)
    counts = torch.bincount(tokens, minlength=6).double() / n
    assert counts[[0, 2, 5]].sum().item() == 0.0
    assert torch.allclose(counts, probs.double(), atol=0.015)
    edges = draw(probs.expand(2, -1), torch.tensor([0.0, 1.0 - 1e-9]))  # both ends of [0, 1)
    assert edges.tolist() == [1, 4]


def test_draw_over_the_whole_vocabulary_reaches_every_chunk_and_the_tail() -> None:
    probs = torch.zeros(VOCAB)
    support = {5: 0.1, 2_000: 0.2, 70_000: 0.3, VOCAB - 1: 0.4}  # the last one lies past the last whole chunk
    for token, mass in support.items():
        probs[token] = mass
    n, batch = 4_000, 100
    rows = probs.expand(batch, -1).contiguous()
    uniforms = torch.rand(n, generator=torch.Generator().manual_seed(3))
    tokens = torch.cat([draw(rows, uniforms[i : i + batch]) for i in range(0, n, batch)])
    counts = {t: c / n for t, c in zip(*torch.unique(tokens, return_counts=True), strict=True)}
    assert set(int(t) for t in counts) == set(support)
    for token, share in counts.items():
        assert abs(float(share) - support[int(token)]) < 0.03


# CI has no GPU: the CUDA case runs where one is present (it caught a search key left on the CPU, which failed
# every sampled request's step on an H200) and is skipped, saying so, everywhere else.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
def test_draw_works_where_the_logits_are(device: str) -> None:
    probs = torch.zeros(2, VOCAB)
    probs[:, [7, 70_000, VOCAB - 1]] = torch.tensor([0.2, 0.5, 0.3])
    uniforms = torch.tensor([0.1, 0.95])
    tokens = draw(probs.to(device), uniforms.to(device))
    assert tokens.device.type == device and tokens.tolist() == draw(probs, uniforms).tolist() == [7, VOCAB - 1]
    logits = torch.log(probs + 1e-30).to(device)
    assert row_argmax(logits).tolist() == [70_000, 70_000]
