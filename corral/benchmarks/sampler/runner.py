"""Times `sample_rows` against the plain torch operations it replaced, on logits of the model's vocabulary.

Each configuration is run on the same random logits by corral's sampler and by the reference (torch.argmax,
torch.multinomial over the softmax, a full descending sort for the filters), alternating, so both see the same
machine load. Time is the calling thread's CPU time (`time.thread_time`) with torch on one thread: on a shared
machine that is far steadier than wall time and is what a step costs the engine thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from corral.benchmarks.timing_report import cpu_ms, speedup_of
from corral.server.engine.sampling import SamplingParams, sample_rows

# (label, params): what OpenAI and vLLM clients send most
CONFIGS: tuple[tuple[str, SamplingParams], ...] = (
    ("greedy (temperature 0)", SamplingParams(temperature=0.0)),
    ("temperature 1 (OpenAI default)", SamplingParams(temperature=1.0)),
    ("temperature 0.7, top_p 0.9", SamplingParams(temperature=0.7, top_p=0.9)),
    ("top_k 50", SamplingParams(temperature=1.0, top_k=50)),
    ("min_p 0.05", SamplingParams(temperature=1.0, min_p=0.05)),
    ("top_k 40, top_p 0.95, min_p 0.02", SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.02)),
)


@dataclass(frozen=True)
class SamplerResult:
    config: str
    batch: int
    corral_ms: float  # CPU ms per step (all rows)
    reference_ms: float

    @property
    def speedup(self) -> float:
        return speedup_of(self.reference_ms, self.corral_ms)

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "speedup": self.speedup}


def reference_sample(logits: torch.Tensor, params: Sequence[SamplingParams]) -> list[int]:
    """The textbook step: argmax, or temperature → min_p → top_k → top_p over a full sort → multinomial."""
    p = params[0]
    if p.greedy:
        return [int(t) for t in torch.argmax(logits, dim=-1).tolist()]
    x = logits / p.temperature
    if p.filtered:
        ordered, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        drop = probs < p.min_p * probs[:, :1]
        if p.top_k > 0:
            drop |= torch.arange(x.shape[1])[None, :] >= p.top_k
        kept = torch.softmax(ordered.masked_fill(drop, float("-inf")), dim=-1)
        drop |= (torch.cumsum(kept, dim=-1) - kept) > p.top_p
        x = x.scatter(1, order, ordered.masked_fill(drop, float("-inf")))
    return [int(t) for t in torch.multinomial(torch.softmax(x, dim=-1), 1).squeeze(1).tolist()]


def run_sampler_bench(
    vocab: int, batches: Sequence[int], repeats: int, scale: float, on_result: Callable[[SamplerResult], None]
) -> list[SamplerResult]:
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    results = []
    for label, params in CONFIGS:
        for batch in batches:
            logits = torch.randn(batch, vocab, generator=generator) * scale
            rows = [params] * batch

            def corral(rows: Sequence[SamplingParams] = rows, logits: torch.Tensor = logits) -> object:
                return sample_rows(logits.clone(), rows, [None] * len(rows))

            def reference(rows: Sequence[SamplingParams] = rows, logits: torch.Tensor = logits) -> object:
                return reference_sample(logits.clone(), rows)

            corral()
            reference()  # warm both
            corral_total = reference_total = 0.0
            for _ in range(3):  # alternate so both see the same load
                corral_total += cpu_ms(corral, repeats)
                reference_total += cpu_ms(reference, repeats)
            result = SamplerResult(label, batch, corral_total / 3, reference_total / 3)
            results.append(result)
            on_result(result)
    return results
