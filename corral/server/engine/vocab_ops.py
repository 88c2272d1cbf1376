"""Whole-vocabulary operations of one decode step, written for CPU cost.

A vocabulary of 128k entries makes the obvious tensor calls the most expensive part of a sampled step on CPU
(measured with `corral bench sampler`: docs/measured-choices.md#vocabulary-operations): `torch.argmax` walks the
row without vectorising, `torch.multinomial` and `exponential_` generate one random number per entry, and a full
descending sort for top-p/top-k costs ~10 ms per row. Each function here gives the same answer with work
proportional to what the answer needs: an argmax through vectorised chunk maxima, one uniform number per row
against the cumulative distribution, and filters that sort only the tokens that can survive them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_CHUNK = 1024  # argmax: per-chunk maxima first (vectorised), then one chunk's argmax
# top-p: try these cut-offs (fractions of the most likely token's probability) before sorting a whole row.
_NUCLEUS_CUTOFFS = (1e-2, 1e-4, 1e-6)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of each row's maximum in [B, V], the first one on ties (as `torch.argmax`)."""
    rows, width = x.shape
    chunks = width // _CHUNK
    if chunks < 4:
        return torch.argmax(x, dim=-1)
    x = x.contiguous()
    head = x[:, : chunks * _CHUNK].reshape(rows, chunks, _CHUNK)
    best_chunk = head.amax(dim=-1).argmax(dim=-1)  # the first chunk holding the maximum
    arange = torch.arange(rows, device=x.device)
    within = head[arange, best_chunk]
    best = within.argmax(dim=-1)
    index = best_chunk * _CHUNK + best
    if chunks * _CHUNK < width:
        tail_value, tail_index = x[:, chunks * _CHUNK :].max(dim=-1)
        later = tail_value > within[arange, best]  # strictly greater: an earlier equal maximum wins
        index = torch.where(later, tail_index + chunks * _CHUNK, index)
    return index


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of probabilities [B, V] (need not sum to 1) by inverting its cumulative
    distribution at `uniforms` [B] in [0, 1). A token of probability 0 is never drawn.

    Two levels, so only one vectorised pass touches the whole row: chunk sums pick the chunk holding the
    target mass, then one chunk's cumulative sum picks the token."""
    rows, width = probs.shape
    chunks = width // _CHUNK
    probs = probs.contiguous()
    sums = [probs[:, : chunks * _CHUNK].reshape(rows, chunks, _CHUNK).sum(dim=-1)] if chunks else []
    if chunks * _CHUNK < width:
        sums.append(probs[:, chunks * _CHUNK :].sum(dim=-1, keepdim=True))
    block_cdf = torch.cumsum(torch.cat(sums, dim=1).double(), dim=1)
    targets = uniforms.double() * block_cdf[:, -1]
    blocks = torch.searchsorted(block_cdf, targets[:, None], right=True).squeeze(1).tolist()
    out = []
    for row, block in enumerate(blocks):
        block = min(block, block_cdf.shape[1] - 1)
        before = float(block_cdf[row, block - 1]) if block else 0.0
        start = block * _CHUNK
        out.append(start + _invert(probs[row, start : start + _CHUNK], float(targets[row]) - before))
    return torch.tensor(out, dtype=torch.long, device=probs.device)


def _invert(mass: torch.Tensor, target: float) -> int:
    """The first index whose cumulative mass exceeds `target`: a zero-mass entry (the same cumulative mass
    as its predecessor) is never the answer; rounding past the end gives the last entry with mass."""
    cdf = torch.cumsum(mass.double(), dim=0)
    key = torch.tensor([max(target, 0.0)], dtype=torch.float64, device=cdf.device)  # on a GPU too
    index = int(torch.searchsorted(cdf, key, right=True))
    if index < mass.shape[0]:
        return index
    return int(torch.nonzero(mass > 0)[-1]) if bool((mass > 0).any()) else mass.shape[0] - 1


def filter_logits(x: torch.Tensor, min_p: Sequence[float], top_k: Sequence[int], top_p: Sequence[float]) -> None:
    """min_p, then top_k, then top_p on temperature-scaled logits [R, V], in place: dropped tokens become
    -inf. The most likely token always survives. top_k <= 0 and top_p >= 1 are off."""
    probs = torch.softmax(x, dim=-1)
    for row in range(x.shape[0]):
        keep = _kept(probs[row], min_p[row], top_k[row], top_p[row])
        x[row].masked_fill_(~keep, float("-inf"))


def _kept(p: torch.Tensor, min_p: float, top_k: int, top_p: float) -> torch.Tensor:
    # The most likely token passes min_p (p_max >= min_p * p_max) and top_k, and _nucleus keeps it.
    keep: torch.Tensor | None = p >= min_p * p.max() if min_p > 0.0 else None
    ranked: torch.Tensor | None = None
    if 0 < top_k < p.shape[0]:
        # min_p drops only the least likely, so the k most likely overall are the k most likely it kept.
        ranked = torch.topk(p, top_k).indices
        by_rank = torch.zeros_like(p, dtype=torch.bool)
        by_rank[ranked] = True
        keep = by_rank if keep is None else keep & by_rank
    if top_p < 1.0:
        nucleus = _nucleus(p if keep is None else torch.where(keep, p, 0.0), top_p, ranked)
        keep = nucleus if keep is None else keep & nucleus
    return torch.ones_like(p, dtype=torch.bool) if keep is None else keep


def _nucleus(p: torch.Tensor, top_p: float, ranked: torch.Tensor | None) -> torch.Tensor:
    """The smallest most-likely prefix of `p` (zeros: already dropped) whose share of the mass reaches top_p.

    Only candidates are sorted: the top-k set when there is one, else the tokens above a cut-off once they
    hold more than top_p of the mass (every token below it then lies past the prefix)."""
    total = p.sum(dtype=torch.float64)
    candidates = ranked
    if candidates is None:
        p_max = float(p.max())
        for fraction in _NUCLEUS_CUTOFFS:
            above = torch.nonzero(p > fraction * p_max).squeeze(1)
            if float(p[above].sum(dtype=torch.float64)) > top_p * float(total):
                candidates = above
                break
        else:
            candidates = torch.nonzero(p > 0).squeeze(1)
    # float64: the boundary of a flat distribution's nucleus is a sum over up to the whole vocabulary.
    ordered, order = torch.sort(p[candidates].double(), descending=True)
    before = (torch.cumsum(ordered, dim=0) - ordered) / total  # share of the more likely kept tokens
    keep = torch.zeros_like(p, dtype=torch.bool)
    keep[candidates[order[before <= top_p]]] = True
    keep[candidates[order[0]]] = True
    return keep
