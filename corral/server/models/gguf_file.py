"""A GGUF file's tensors where they lie: memory-mapped, handed to ggml without a copy, as llama.cpp serves them.

The file is mapped read-only once. A quantized weight becomes a ggml tensor whose data pointer is its place in
the mapping: the kernel page cache holds the file's bytes and every process that maps it shares them, so a
served model costs its file's size in memory (less what is never read, such as the embedding's unused rows),
with no float copy on disk or in memory. Small float tensors (norm gains, biases, RoPE factors) are copied
out, a few hundred KB.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from corral.kernels.row_kernel import ggml_function, ggml_modules
from corral.server.models.gguf_header import GGUFHeaderError, TensorInfo, read_tensor_index

_F32, _F16 = 0, 1


# ggml types whose products have an interleaved layout and kernels on AVX2 (ggml-cpu's repack: Q4_0, Q4_K, IQ4_NL).
_REPACKABLE = frozenset({2, 12, 20})


def repack_buffer_type() -> Any:
    """ggml's CPU_REPACK buffer type (weights in its kernels' interleaved layouts), or None where ggml has none."""
    reg = ggml_function("ggml_backend_cpu_reg", ctypes.c_void_p)()
    device = ggml_function("ggml_backend_reg_dev_get", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(reg, 0)
    address = ggml_function("ggml_backend_reg_get_proc_address", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
        reg, b"ggml_backend_dev_get_extra_bufts")
    if not reg or not device or not address:
        return None
    kinds = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(address)(device)
    name = ggml_function("ggml_backend_buft_name", ctypes.c_char_p, ctypes.c_void_p)
    index = 0
    while kinds and kinds[index]:
        if name(kinds[index]) == b"CPU_REPACK":
            return kinds[index]
        index += 1
    return None


def _alloc_tensors(ctx: Any, kind: Any) -> Any:
    return ggml_function("ggml_backend_alloc_ctx_tensors_from_buft", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)(
        ctypes.cast(ctx, ctypes.c_void_p), kind)


def _tensor_set(tensor: Any, source: int, nbytes: int) -> None:
    ggml_function("ggml_backend_tensor_set", None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t)(
        ctypes.cast(tensor, ctypes.c_void_p), ctypes.c_void_p(source), 0, nbytes)


def _buffer_free(buffer: Any) -> None:
    ggml_function("ggml_backend_buffer_free", None, ctypes.c_void_p)(buffer)


class GGUFTensorError(ValueError):
    """The file lacks a tensor or holds one of another shape or type than the model needs."""


class WideRows:
    """From how many rows a product takes a repacked weight's own blocks instead of its repacked copy (None:
    never), one choice per file (`GgufFile.settle_wide_rows`). ggml's tiled K-quant kernels multiply many rows by
    a file's own blocks faster than its repacked kernels do on some CPUs (an AMD EPYC: Qwen2.5 1.5B's 512-token
    prompt 1.7x as fast), while one row is faster repacked; a graph asks for its product's rows when it is built."""

    def __init__(self) -> None:
        self.start: int | None = None


@dataclass(frozen=True)
class MappedWeight:
    """A weight as ggml multiplies it: a tensor over the mapping [in_features, out_features] (ggml's order), or
    a repacked copy of it (`blocks` then keeps the tensor over the mapping, for products of `wide.start` rows and
    more)."""

    name: str
    ggml_weight: Any
    ggml_type: int
    in_features: int
    out_features: int
    nbytes: int
    blocks: Any = None
    wide: WideRows | None = None

    def for_rows(self, rows: int) -> Any:
        """The tensor a product of `rows` rows multiplies by."""
        start = self.wide.start if self.wide is not None else None
        if self.blocks is not None and start is not None and rows >= start:
            return self.blocks
        return self.ggml_weight


class GgufFile:
    """A GGUF's tensors, memory-mapped. `weight` hands ggml a tensor over the file's bytes; `floats` copies a
    small float tensor out; `dequantized_rows` decodes some rows of a quantized weight to float32."""

    def __init__(self, path: Path) -> None:
        try:
            self.index: dict[str, TensorInfo] = read_tensor_index(path)
        except (GGUFHeaderError, OSError) as exc:
            raise GGUFTensorError(f"{path} is not a readable GGUF file: {exc}") from exc
        self.path = path
        with open(path, "rb") as handle:
            self._mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        self._map = np.frombuffer(self._mapping, dtype=np.uint8)
        self._base = int(self._map.ctypes.data)
        self._repacked: list[tuple[Any, Any]] = []  # (context, buffer) of weights repacked for ggml's GEMM kernels
        self.repacked_bytes = 0
        ggml, _ = ggml_modules()
        self._ggml = ggml
        overhead = int(ggml.ggml_tensor_overhead())
        params = ggml.ggml_init_params(mem_size=overhead * (len(self.index) + 8), mem_buffer=None, no_alloc=True)
        self._ctx: Any = ggml.ggml_init(params)
        if not self._ctx:
            raise MemoryError("ggml could not allocate the descriptions of the file's tensors")
        self._weights: dict[str, MappedWeight] = {}
        self.wide_rows = WideRows()

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
        made = MappedWeight(name, self._mapped_tensor(info), info.ggml_type, in_features, out_features, nbytes)
        self._weights[name] = made
        return made

    def _mapped_tensor(self, info: TensorInfo) -> Any:
        tensor = self._ggml.ggml_new_tensor_2d(self._ctx, info.ggml_type, info.dims[0], info.dims[1])
        tensor.contents.data = ctypes.c_void_p(self._base + info.offset)
        return tensor

    def repack(self, names: Iterable[str]) -> int:
        """Repack the named weights that ggml's CPU kernels take in an interleaved layout on this CPU (on AVX2: Q4_0,
        Q4_K, IQ4_NL with rows in multiples of 8) into a buffer of that layout, as llama.cpp does at load: their
        products then run ggml's GEMM/GEMV kernels for it (faster prompts and steps on Qwen2.5 1.5B; measured:
        docs/measured-choices.md#gguf-repacking). Each keeps its tensor over the file's blocks beside it until
        `settle_wide_rows` says whether products of many rows take those. Returns the bytes repacked; 0 where ggml
        offers no such layout. Call before `weight` hands the weights out."""
        kind = repack_buffer_type()
        wanted = [n for n in names if self._repackable(n)] if kind is not None else []
        if not wanted:
            return 0
        ggml = self._ggml
        overhead = int(ggml.ggml_tensor_overhead())
        ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=overhead * (len(wanted) + 4), mem_buffer=None,
                                                   no_alloc=True))
        made = {}
        for name in wanted:
            info = self.info(name)
            made[name] = ggml.ggml_new_tensor_2d(ctx, info.ggml_type, info.dims[0], info.dims[1])
        buffer = _alloc_tensors(ctx, kind)
        if not buffer:
            ggml.ggml_free(ctx)
            size = sum(self.nbytes(n) for n in wanted)
            raise MemoryError(f"ggml could not allocate {size} bytes of repacked weights")
        self._repacked.append((ctx, buffer))
        total = 0
        for name, tensor in made.items():
            if not tensor.contents.extra:  # ggml chose no layout for it after all: it stays where it lies
                continue
            info, nbytes = self.info(name), self.nbytes(name)
            _tensor_set(tensor, self._base + info.offset, nbytes)
            self._weights[name] = MappedWeight(name, tensor, info.ggml_type, info.dims[0], info.dims[1], nbytes,
                                               blocks=self._mapped_tensor(info), wide=self.wide_rows)
            total += nbytes
        self.repacked_bytes += total
        return total

    def settle_wide_rows(self, start: int | None) -> None:
        """Products of `start` rows and more take the repacked weights' own blocks (None: none do). With none, the
        file's pages of those weights are released from this process: the copy replaces them, and the memory
        stays one weight's worth; else both are kept (the blocks are read only by steps that wide)."""
        self.wide_rows.start = start
        if start is not None:
            return
        for name in self.repacked_names():
            self._release(self.info(name).offset, self.nbytes(name))

    def repacked_names(self) -> list[str]:
        """The weights repacked (each with its blocks beside it)."""
        return [name for name, weight in self._weights.items() if weight.blocks is not None]

    def _repackable(self, name: str) -> bool:
        info = self.index.get(name)
        return (info is not None and len(info.dims) == 2 and info.ggml_type in _REPACKABLE
                and info.dims[1] % 8 == 0 and name not in self._weights and bool(self._ggml.ggml_cpu_has_avx2()))

    def _release(self, offset: int, nbytes: int) -> None:
        """Drop this process's mapping of a range it no longer reads (whole pages inside it)."""
        start = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (offset + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start and hasattr(mmap, "MADV_DONTNEED"):
            self._mapping.madvise(mmap.MADV_DONTNEED, start, end - start)

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
        for ctx, buffer in self._repacked:
            _buffer_free(buffer)
            self._ggml.ggml_free(ctx)
        self._repacked = []

    def __del__(self) -> None:
        self.close()
