"""The memory-bandwidth limit of a decode step, measured in the same run: a STREAM-like read of a buffer far
larger than the caches (torch's `sum`, on the threads torch uses, as the model's matmuls do), and the limit
it sets on TPOT at concurrency 1 — every weight is read at least once per token, so a step cannot take less
than weight bytes ÷ read bandwidth. `tpot_over_limit` says how far from that floor corral decodes.

The read is taken before the runs and again after them, and the higher counts: on a shared machine other work
only ever lowers a reading (seen here: 14 GB/s in one run where the runs before and after read 25-26), and a
floor from a low reading would flatter the TPOT measured against it."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

READ_BYTES = 1 << 29  # 512 MiB: far past any last-level cache here
REPEATS = 5


def read_bandwidth(size_bytes: int = READ_BYTES, repeats: int = REPEATS) -> float:
    """Bytes per second a full read of a `size_bytes` float32 buffer reaches (median of `repeats`)."""
    import torch

    buffer = torch.ones(size_bytes // 4, dtype=torch.float32)
    buffer.sum()  # touch every page before timing
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        seconds.append(time.perf_counter() - start)
    return buffer.numel() * 4 / statistics.median(seconds)


def bandwidth_section(
    readings: Sequence[float], model: dict[str, Any], runs: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    """results.json's `bandwidth`: the read bandwidth (the highest of `readings`, bytes per second), the model's
    weight bytes at its serving dtype (`/v1/models`), the TPOT floor they give, and each concurrency-1 run's TPOT
    p50 as a multiple of it."""
    read_bytes_per_s = max(readings)
    weight_bytes = model.get("weight_bytes")
    limit_ms = weight_bytes / read_bytes_per_s * 1000 if weight_bytes else None
    over = {
        run["mode"]: round(run["tpot_ms_p50"] / limit_ms, 3)
        for run in runs
        if run["concurrency"] == 1 and limit_ms and run.get("tpot_ms_p50") is not None
    }
    return {
        "read_gb_s": round(read_bytes_per_s / 1e9, 3),
        "read_gb_s_readings": [round(r / 1e9, 3) for r in readings],
        "weight_bytes": weight_bytes,
        "dtype": model.get("dtype"),
        "quantization": model.get("quantization", "none"),
        "limit_ms_per_token": round(limit_ms, 3) if limit_ms else None,
        "tpot_over_limit": over,
        "notes": "TPOT floor = weight bytes at the serving dtype (or as quantized) ÷ the read bandwidth, the "
                 "higher of two reads, before the runs and after them; tpot_over_limit = the concurrency-1 run's "
                 "TPOT p50 ÷ that floor (1.0 is the floor).",
    }


def bandwidth_line(section: dict[str, Any]) -> str:
    if section.get("limit_ms_per_token") is None:
        return f"read bandwidth {section['read_gb_s']} GB/s; the server reported no weight bytes"
    over = ", ".join(f"{mode} {ratio:.2f}x" for mode, ratio in section["tpot_over_limit"].items())
    quantization = section.get("quantization", "none")
    held = section["dtype"]
    if quantization not in (None, "none"):
        held = f"{quantization} quantization, {held} elsewhere"
    return (f"read bandwidth {section['read_gb_s']} GB/s, weights {section['weight_bytes'] / 1e6:.1f} MB "
            f"({held}): TPOT floor {section['limit_ms_per_token']:.2f} ms; TPOT p50 at concurrency 1 = "
            f"{over} the floor")
