"""Mask-latency summaries that merge across schemas: exact count/sum/max plus a log-binned histogram."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

# 20 bins per decade: ~12 % wide, fine enough for p50/p99 and a CDF plot; bin k covers [10^(k/20), 10^((k+1)/20)).
BINS_PER_DECADE = 20


def bin_of(value_us: float) -> int:
    return math.floor(math.log10(max(value_us, 1e-3)) * BINS_PER_DECADE)


def bin_upper(index: int) -> float:
    return float(10 ** ((index + 1) / BINS_PER_DECADE))


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list (q in 0..1)."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


@dataclass
class LatencyHistogram:
    count: int = 0
    total_us: float = 0.0
    max_us: float = 0.0
    bins: dict[int, int] = field(default_factory=dict)

    def add(self, value_us: float) -> None:
        self.count += 1
        self.total_us += value_us
        self.max_us = max(self.max_us, value_us)
        k = bin_of(value_us)
        self.bins[k] = self.bins.get(k, 0) + 1

    def merge(self, other: LatencyHistogram) -> None:
        self.count += other.count
        self.total_us += other.total_us
        self.max_us = max(self.max_us, other.max_us)
        for k, n in other.bins.items():
            self.bins[k] = self.bins.get(k, 0) + n

    @property
    def mean_us(self) -> float:
        return self.total_us / self.count if self.count else math.nan

    def quantile(self, q: float) -> float:
        """Upper edge of the bin holding the q-quantile (capped by the exact max)."""
        if not self.count:
            return math.nan
        target = max(1, math.ceil(q * self.count))
        seen = 0
        for k in sorted(self.bins):
            seen += self.bins[k]
            if seen >= target:
                return min(bin_upper(k), self.max_us)
        return self.max_us

    def cdf(self) -> tuple[list[float], list[float]]:
        xs: list[float] = []
        ys: list[float] = []
        seen = 0
        for k in sorted(self.bins):
            seen += self.bins[k]
            xs.append(min(bin_upper(k), self.max_us))
            ys.append(seen / self.count)
        return xs, ys

    def to_json(self) -> dict[str, Any]:
        return {"count": self.count, "total_us": round(self.total_us, 3), "max_us": round(self.max_us, 3),
                "bins": {str(k): n for k, n in sorted(self.bins.items())}}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> LatencyHistogram:
        return cls(int(raw["count"]), float(raw["total_us"]), float(raw["max_us"]),
                   {int(k): int(n) for k, n in raw.get("bins", {}).items()})

    @classmethod
    def of(cls, values: Iterable[float]) -> LatencyHistogram:
        hist = cls()
        for v in values:
            hist.add(v)
        return hist
