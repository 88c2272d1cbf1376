"""Times `Projection` (oneDNN-packed weights) against `F.linear` for weight shapes a CPU-served model has.

Both run on the same inputs, alternating, with torch on one thread (as the engine thread runs). Time is the
calling thread's CPU time, steadier than wall time on a shared machine. Shapes are (out_features,
in_features); the defaults are the tiny model's (corral-tiny) vocabulary projection and the projections of
a Llama-3.2-1B-shaped layer (hidden 2,048, fused q/k/v with 8 of 32 heads for k and v, fused gate/up).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from corral.benchmarks.timing_report import cpu_ms, speedup_of
from corral.kernels.projection import Projection

DEFAULT_SHAPES: tuple[tuple[str, int, int], ...] = (
    ("default model head", 128_257, 64),
    ("1B-shaped q/k/v", 3_072, 2_048),
    ("1B-shaped o", 2_048, 2_048),
    ("1B-shaped gate/up", 16_384, 2_048),
    ("1B-shaped down", 2_048, 8_192),
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ProjectionResult:
    shape: str
    out_features: int
    in_features: int
    dtype: str
    rows: int
    packed: bool  # False: Projection chose F.linear for this shape and row count
    corral_ms: float
    plain_ms: float
    max_abs_diff: float

    @property
    def speedup(self) -> float:
        return speedup_of(self.plain_ms, self.corral_ms)

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "speedup": self.speedup}


def run_projection_bench(
    shapes: Sequence[tuple[str, int, int]],
    dtypes: Sequence[str],
    batches: Sequence[int],
    repeats: int,
    on_result: Callable[[ProjectionResult], None],
) -> list[ProjectionResult]:
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    results = []
    for label, out_features, in_features in shapes:
        for dtype_name in dtypes:
            dtype = DTYPES[dtype_name]
            weight = (torch.randn(out_features, in_features, generator=generator) / in_features**0.5).to(dtype)
            proj = Projection(weight)
            for rows in batches:
                x = torch.randn(rows, in_features, generator=generator).to(dtype)
                packed = proj.uses_packed(rows)

                def corral(x: torch.Tensor = x, proj: Projection = proj) -> torch.Tensor:
                    return proj(x)

                def plain(x: torch.Tensor = x, weight: torch.Tensor = weight) -> torch.Tensor:
                    return F.linear(x, weight)

                diff = float((corral().float() - plain().float()).abs().max()) if rows else 0.0
                corral_total = plain_total = 0.0
                for _ in range(3):  # alternate so both see the same load
                    corral_total += cpu_ms(corral, repeats)
                    plain_total += cpu_ms(plain, repeats)
                result = ProjectionResult(label, out_features, in_features, dtype_name, rows, packed,
                                          corral_total / 3, plain_total / 3, diff)
                results.append(result)
                on_result(result)
    return results
