"""Per-request sampling parameters and the per-row sampler (temperature, top_p, seed, logit_bias)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logit_bias: dict[int, float] = field(default_factory=dict)
    ignore_eos: bool = False  # benchmark aid (vLLM's name): run to max_tokens; stall detection is off
    max_revisions: int | None = None  # None: the engine's default depth limit

    @property
    def greedy(self) -> bool:
        return self.temperature <= 1e-5


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed)
    return generator


def sample_rows(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """One token per row of masked float logits [B, V] (biases are added in place). Greedy rows share one
    argmax; sampled rows differ in parameters and generators, so each is drawn alone."""
    for row, p in enumerate(params):
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=logits.device)
            bias = torch.tensor(list(p.logit_bias.values()), device=logits.device, dtype=logits.dtype)
            logits[row, ids] += bias  # a bias never revives a masked token: -inf stays -inf
    tokens = [0] * len(params)
    greedy = [row for row, p in enumerate(params) if p.greedy]
    if greedy:
        picked = torch.argmax(logits[greedy], dim=-1).tolist()
        for row, token in zip(greedy, picked, strict=True):
            tokens[row] = int(token)
    for row, (p, generator) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            continue
        probs = torch.softmax(logits[row] / p.temperature, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cumulative = torch.cumsum(sorted_probs, dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (always at least one token).
            drop = cumulative - sorted_probs > p.top_p
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        tokens[row] = int(torch.multinomial(probs, 1, generator=generator).item())
    return tokens
