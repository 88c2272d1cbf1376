"""The memory-bandwidth limit of a decode step, measured in the same run: a STREAM-like read of a buffer far
larger than the caches (torch's `sum`, on the threads torch uses, as the model's matmuls do), and the limit
it sets on TPOT at concurrency 1 — every weight is read at least once per token, so a step cannot take less
than weight bytes ÷ read bandwidth. `tpot_over_limit` says how far from that floor corral decodes.

On a shared machine the reading moves with the neighbours' load, not with this run: on this host separate
processes read 26 to 52 GB/s minutes apart, while one process's readings stayed within 10 %. So every
concurrency-1 run is bracketed by its own two reads (taken while no server decodes), and its TPOT is put over
the floor of its own window; the reads before and after the whole benchmark give the headline floor. Of two
reads the higher counts: other work only ever lowers a reading, and a floor from a low one would flatter the
TPOT measured against it. The peer's concurrency-1 TPOT (llama-server reports it in `timings`) is put over
its own window's floor too, so the two servers' distance from the floor is read in the same minutes."""

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


def _limit_ms(weight_bytes: int | None, read_bytes_per_s: float) -> float | None:
    return weight_bytes / read_bytes_per_s * 1000 if weight_bytes and read_bytes_per_s > 0 else None


def _over_own_window(runs: Sequence[dict[str, Any]], weight_bytes: int | None,
                     fallback_bytes_per_s: float) -> dict[str, dict[str, float]]:
    """Each concurrency-1 run's TPOT p50 over the floor of the reads that bracket it (`read_gb_s_window`),
    or over the benchmark's floor where the run has none."""
    out: dict[str, dict[str, float]] = {}
    for run in runs:
        if run["concurrency"] != 1 or run.get("tpot_ms_p50") is None:
            continue
        window = run.get("read_gb_s_window") or []
        read_bytes_per_s = max(window) * 1e9 if window else fallback_bytes_per_s
        limit = _limit_ms(weight_bytes, read_bytes_per_s)
        if limit:
            out[run["mode"]] = {"tpot_ms_p50": round(run["tpot_ms_p50"], 3),
                                "read_gb_s": round(read_bytes_per_s / 1e9, 3), "limit_ms": round(limit, 3),
                                "over_limit": round(run["tpot_ms_p50"] / limit, 3)}
    return out


def bandwidth_section(
    readings: Sequence[float], model: dict[str, Any], runs: Sequence[dict[str, Any]],
    peer_runs: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    """results.json's `bandwidth`: the read bandwidth (the highest of `readings`, bytes per second), the model's
    weight bytes at its serving dtype (`/v1/models`), the TPOT floor they give, and each concurrency-1 run's TPOT
    p50 as a multiple of its own window's floor (corral's in `tpot_over_limit`, the peer's in
    `peer_tpot_over_limit`; the peer serves the same file, so the same weight bytes)."""
    read_bytes_per_s = max(readings)
    weight_bytes = model.get("weight_bytes")
    limit_ms = _limit_ms(weight_bytes, read_bytes_per_s)
    corral = _over_own_window(runs, weight_bytes, read_bytes_per_s)
    peer = _over_own_window(peer_runs, weight_bytes, read_bytes_per_s)
    return {
        "read_gb_s": round(read_bytes_per_s / 1e9, 3),
        "read_gb_s_readings": [round(r / 1e9, 3) for r in readings],
        "weight_bytes": weight_bytes,
        "dtype": model.get("dtype"),
        "quantization": model.get("quantization", "none"),
        "limit_ms_per_token": round(limit_ms, 3) if limit_ms else None,
        "tpot_over_limit": {mode: row["over_limit"] for mode, row in corral.items()},
        "peer_tpot_over_limit": {mode: row["over_limit"] for mode, row in peer.items()},
        "windows": {"corral": corral, "peer": peer},
        "notes": "TPOT floor = weight bytes at the serving dtype (or as quantized) ÷ the read bandwidth; a "
                 "concurrency-1 run's ratio uses the higher of the two reads bracketing that run (its window), "
                 "the headline floor the higher of the reads before and after the whole benchmark. "
                 "tpot_over_limit = TPOT p50 ÷ its window's floor (1.0 is the floor).",
    }


def bandwidth_line(section: dict[str, Any]) -> str:
    if section.get("limit_ms_per_token") is None:
        return f"read bandwidth {section['read_gb_s']} GB/s; the server reported no weight bytes"
    quantization = section.get("quantization", "none")
    held = section["dtype"]
    if quantization not in (None, "none"):
        held = f"{quantization} quantization, {held} elsewhere"
    line = (f"read bandwidth {section['read_gb_s']} GB/s, weights {section['weight_bytes'] / 1e6:.1f} MB "
            f"({held}): TPOT floor {section['limit_ms_per_token']:.2f} ms")
    for side in ("corral", "peer"):
        rows = section.get("windows", {}).get(side) or {}
        if rows:
            line += f"; {side} TPOT p50 at concurrency 1 = " + ", ".join(
                f"{mode} {row['over_limit']:.2f}x ({row['tpot_ms_p50']:.1f} ms over {row['limit_ms']:.1f} ms at "
                f"{row['read_gb_s']:.1f} GB/s)" for mode, row in rows.items())
    return line
