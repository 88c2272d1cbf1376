"""The metadata of a GGUF file, read from its header alone.

The `gguf` package's reader parses every field and maps every tensor before anything can be looked up: over
Gemma 3's 262,144-token vocabulary that is ~15-30 s here, paid on each call. corral needs a handful of keys
(the architecture, the chat template), so this walks the key/value section once, in order, skips what it was
not asked for without decoding it, and stops as soon as it has every key asked for.

Format (GGUF v2/v3, little-endian): magic `GGUF`, uint32 version, uint64 tensor count, uint64 key/value
count, then each pair as a string key (uint64 length + UTF-8), a uint32 value type and the value; an array
is a uint32 item type, a uint64 count and the items.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAGIC = b"GGUF"
VERSIONS = (2, 3)
STRING, ARRAY = 8, 9
# value type -> struct format of a scalar (little-endian)
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


class GGUFHeaderError(ValueError):
    """The file is not a GGUF this reader understands (the message says why)."""


class _Cursor:
    def __init__(self, data: mmap.mmap) -> None:
        self.data = data
        self.at = 0

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.at + size > len(self.data):
            raise GGUFHeaderError("the header ends early (a truncated file?)")
        (value,) = struct.unpack_from(fmt, self.data, self.at)
        self.at += size
        return value

    def string(self, keep: bool) -> str | None:
        length = self.unpack("<Q")
        end = self.at + length
        if end > len(self.data):
            raise GGUFHeaderError("a string runs past the end of the file")
        raw = self.data[self.at : end] if keep else None
        self.at = end
        return raw.decode("utf-8", errors="replace") if raw is not None else None

    def value(self, kind: int, keep: bool) -> Any:
        if kind in SCALARS:
            fmt = SCALARS[kind]
            if keep:
                return self.unpack(fmt)
            self.at += struct.calcsize(fmt)
            return None
        if kind == STRING:
            return self.string(keep)
        if kind == ARRAY:
            item, count = self.unpack("<I"), self.unpack("<Q")
            if item in SCALARS and not keep:  # fixed width: skipped in one move
                self.at += count * struct.calcsize(SCALARS[item])
                return None
            if item == STRING and not keep:  # a vocabulary: step over each string by its length alone
                at, data, length = self.at, self.data, struct.Struct("<Q")
                try:
                    for _ in range(count):
                        at += 8 + length.unpack_from(data, at)[0]
                except struct.error as exc:
                    raise GGUFHeaderError("a string array runs past the end of the file") from exc
                if at > len(data):
                    raise GGUFHeaderError("a string array runs past the end of the file")
                self.at = at
                return None
            items = [self.value(item, keep) for _ in range(count)]
            return items if keep else None
        raise GGUFHeaderError(f"unknown value type {kind}")


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies in the file: its ggml type, its dimensions (ggml's order: the row first) and the
    absolute offset of its data."""

    name: str
    ggml_type: int
    dims: tuple[int, ...]
    offset: int


_DEFAULT_ALIGNMENT = 32


def read_fields(path: Path, keys: tuple[str, ...]) -> dict[str, Any]:
    """The values of `keys` found in the file's metadata (absent ones are left out). GGUFHeaderError on a file
    that is not GGUF v2/v3 or whose header is broken; OSError if it cannot be read."""
    return _walk(path, keys, tensors=False)[0]


def read_tensor_index(path: Path) -> dict[str, TensorInfo]:
    """Every tensor of the file by name, with its type, dimensions and data offset: the key/value section is
    walked without decoding what is skipped (the vocabulary's strings are stepped over), then the tensor infos
    are read. Seconds against the `gguf` reader's ~26 s for Qwen2.5's 151,936-token vocabulary."""
    return _walk(path, ("general.alignment",), tensors=True)[1]


def _walk(path: Path, keys: tuple[str, ...], tensors: bool) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    wanted = set(keys)
    found: dict[str, Any] = {}
    index: dict[str, TensorInfo] = {}
    with open(path, "rb") as handle:
        if path.stat().st_size < 24:
            raise GGUFHeaderError("the file is too short to be GGUF")
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            cursor = _Cursor(data)
            if data[:4] != MAGIC:
                raise GGUFHeaderError("it does not start with the GGUF magic")
            cursor.at = 4
            version = cursor.unpack("<I")
            if version not in VERSIONS:
                raise GGUFHeaderError(f"GGUF version {version} (read: {', '.join(map(str, VERSIONS))})")
            count = cursor.unpack("<Q")
            pairs = cursor.unpack("<Q")
            for _ in range(pairs):
                if not wanted and not tensors:
                    break
                key = cursor.string(keep=True)
                kind = cursor.unpack("<I")
                keep = key in wanted
                value = cursor.value(kind, keep)
                if keep and key is not None:
                    found[key] = value
                    wanted.discard(key)
            if tensors:
                index = _tensor_infos(cursor, count, int(found.get("general.alignment") or _DEFAULT_ALIGNMENT))
                for info in index.values():
                    if info.offset > len(data):
                        raise GGUFHeaderError(f"tensor {info.name} lies past the end of the file (truncated?)")
    return found, index


def _tensor_infos(cursor: _Cursor, count: int, alignment: int) -> dict[str, TensorInfo]:
    """The tensor infos after the key/value section; offsets made absolute (the data section starts at the
    next multiple of the alignment)."""
    raw = []
    for _ in range(count):
        name = cursor.string(keep=True) or ""
        dims = tuple(cursor.unpack("<Q") for _ in range(cursor.unpack("<I")))
        raw.append((name, cursor.unpack("<I"), dims, cursor.unpack("<Q")))
    start = -(-cursor.at // alignment) * alignment
    return {name: TensorInfo(name, kind, dims, start + offset) for name, kind, dims, offset in raw}
