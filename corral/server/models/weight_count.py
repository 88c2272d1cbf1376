"""How many weights a served checkpoint holds, read from its safetensors headers (no tensor is loaded): what a
decode step reads at least once per token, so `corral bench serve` can put TPOT beside the memory-bandwidth
limit. Tied weights (Gemma's embedding and head) are stored, and counted, once."""

from __future__ import annotations

import math
from pathlib import Path

from safetensors import safe_open


def weight_elements(path: Path) -> int | None:
    """The elements of every tensor in the checkpoint's `*.safetensors` files; None where it has none."""
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        return None
    total = 0
    for file in files:
        with safe_open(str(file), "pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                total += math.prod(handle.get_slice(key).get_shape())
    return total
