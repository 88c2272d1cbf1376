"""A GGUF file's tensors where they lie: memory-mapped, handed to ggml without a copy, as llama.cpp serves them.

The file is mapped read-only once. A quantized weight becomes a ggml tensor whose data pointer is its place in
the mapping: the kernel page cache holds the file's bytes and every process that maps it shares them, so a
served model costs its file's size in memory (less what is never read, such as the embedding's unused rows),
with no float copy on disk or in memory. Small float tensors (norm gains, biases, RoPE factors) are copied
out, a few hundred KB.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from server.models.gguf_header import GGUFHeaderError, TensorInfo, read_tensor_index
from server.models.row_kernel import ggml_modules

_F32, _F16 = 0, 1


class GGUFTensorError(ValueError):
    """The file lacks a tensor or holds one of another shape or type than the model needs."""


@dataclass(frozen=True)
class MappedWeight:
    """A weight as ggml multiplies it: a tensor over the mapping [in_features, out_features] (ggml's order)."""

    name: str
    ggml_weight: Any
    ggml_type: int
    in_features: int
    out_features: int
    nbytes: int


class GgufFile:
    """A GGUF's tensors, memory-mapped. `weight` hands ggml a tensor over the file's bytes; `floats` copies a
    small float tensor out; `dequantized_rows` decodes some rows of a quantized weight to float32."""

    def __init__(self, path: Path) -> None:
        try:
            self.index: dict[str, TensorInfo] = read_tensor_index(path)
        except (GGUFHeaderError, OSError) as exc:
            raise GGUFTensorError(f"{path} is not a readable GGUF file: {exc}") from exc
        self.path = path
        self._map = np.memmap(path, dtype=np.uint8, mode="r")
        self._base = int(self._map.ctypes.data)
        ggml, _ = ggml_modules()
        self._ggml = ggml
        overhead = int(ggml.ggml_tensor_overhead())
        params = ggml.ggml_init_params(mem_size=overhead * (len(self.index) + 8), mem_buffer=None, no_alloc=True)
        self._ctx: Any = ggml.ggml_init(params)
        if not self._ctx:
            raise MemoryError("ggml could not allocate the descriptions of the file's tensors")
        self._weights: dict[str, MappedWeight] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.index

    def info(self, name: str) -> TensorInfo:
        found = self.index.get(name)
        if found is None:
            raise GGUFTensorError(f"{self.path.name} has no tensor {name}")
        return found

    def nbytes(self, name: str) -> int:
        info = self.info(name)
        return int(self._ggml.ggml_row_size(info.ggml_type, info.dims[0])) * int(np.prod(info.dims[1:], dtype=np.int64))

    def weight(self, name: str) -> MappedWeight:
        """A 2-D weight [out_features rows of in_features] as a ggml tensor over the mapping (made once)."""
        made = self._weights.get(name)
        if made is not None:
            return made
        info = self.info(name)
        if len(info.dims) != 2:
            raise GGUFTensorError(f"{name} in {self.path.name} has {len(info.dims)} dimensions, not 2")
        in_features, out_features = info.dims
        nbytes = self.nbytes(name)
        if info.offset + nbytes > self._map.size:
            raise GGUFTensorError(f"{name} runs past the end of {self.path.name} (a truncated file?)")
        tensor = self._ggml.ggml_new_tensor_2d(self._ctx, info.ggml_type, in_features, out_features)
        tensor.contents.data = ctypes.c_void_p(self._base + info.offset)
        made = MappedWeight(name, tensor, info.ggml_type, in_features, out_features, nbytes)
        self._weights[name] = made
        return made

    def floats(self, name: str) -> torch.Tensor:
        """A float tensor (F32 or F16 in the file) copied out as float32, in torch's order (the row last)."""
        info = self.info(name)
        if info.ggml_type not in (_F32, _F16):
            raise GGUFTensorError(f"{name} in {self.path.name} is quantized; corral reads it as float")
        dtype = np.float32 if info.ggml_type == _F32 else np.float16
        count = int(np.prod(info.dims, dtype=np.int64))
        raw = np.frombuffer(self._map, dtype=dtype, count=count, offset=info.offset)
        return torch.from_numpy(raw.astype(np.float32)).view(*reversed(info.dims))

    def dequantized_rows(self, name: str, rows: np.ndarray) -> np.ndarray:
        """Rows of a 2-D weight, decoded to float32 [len(rows), in_features] (the `gguf` package's decoders)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        info = self.info(name)
        row_bytes = int(self._ggml.ggml_row_size(info.ggml_type, info.dims[0]))
        table = np.ndarray((info.dims[1], row_bytes), dtype=np.uint8, buffer=self._map, offset=info.offset)
        return np.asarray(dequantize(table[rows], GGMLQuantizationType(info.ggml_type)), dtype=np.float32)

    def close(self) -> None:
        if self._ctx:
            self._ggml.ggml_free(self._ctx)
            self._ctx = None

    def __del__(self) -> None:
        self.close()
