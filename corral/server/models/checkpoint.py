"""Read a Hugging Face checkpoint's weights straight from its safetensors files (one file or a sharded index)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

SINGLE_FILE = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"


class CheckpointError(Exception):
    """The checkpoint's weight files are missing or inconsistent; the message is meant for the user."""


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files of `model_dir`: the shards its index names, or its single file."""
    index = model_dir / SHARD_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index} is not a valid safetensors index: {exc}") from exc
        files = [model_dir / name for name in dict.fromkeys(str(v) for v in weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names shards that are missing: {', '.join(missing)}")
        return files
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [single]
    raise CheckpointError(f"{model_dir} has no {SINGLE_FILE} or {SHARD_INDEX}")


def iter_tensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every weight, read lazily one tensor at a time (peak memory: one tensor)."""
    from safetensors import safe_open

    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                yield name, handle.get_tensor(name)
