"""A few rows through an fp16 weight, on ggml's CPU kernels: decode steps at low concurrency.

One row reads every weight once for one dot product per output, so a projection there costs what its weight
costs to read, if the kernel keeps up with the memory. fbgemm's fp16 kernel (`quantized.linear_dynamic_fp16`,
what corral's fp16 projections use) does not at one row on an AVX2 CPU: it reads Gemma 3 270M's layer
projections well below the rate the cores stream at. ggml, llama.cpp's tensor library (through the `ggml-python`
bindings, the `ggml` extra), multiplies the same fp16 weights at the rate the cores stream, the layers and the
head alike. Past a few rows fbgemm's kernel, which reuses each weight it reads across them, is the faster at the
products, but the decoder as one ggml graph beats ggml's products with torch's arithmetic around them, whose small
operations outweigh what fbgemm's products would save there (measured on an AMD EPYC and an Intel Xeon:
docs/measured-choices.md#row-kernel). So a layer sends up to `LAYER_MAX_ROWS` tokens here (a constrained step's
rows carry jump-forward tokens too) and the head one row.

ggml's F16 dot product takes its input in fp16 too (as llama.cpp computes an F16 model), so a row's outputs are
rounded a little against fbgemm's (float32 input): the head reports `rounds_outputs` and the logits that decide
a pick are recomputed exactly (corral/kernels/logit_refinement.py), so one row and several agree on the choice.

`--row-kernel torch` (`CORRAL_ROW_KERNEL=torch`) turns it off (for comparisons), `products` keeps ggml for the
products but runs the rest of a layer in torch instead of as ggml graphs (corral/kernels/ggml_layers.py); without
the `ggml` package it is off.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from corral.kernels.choice import chosen_kernels

_ggml: Any
_ggml_utils: Any
# torch is imported first on purpose: ggml's CPU backend links the system's libgomp.so.1, and the loader then
# binds it to the libgomp torch already loaded (same soname), so ggml's parallel regions run on the engine
# thread's one OpenMP team instead of a second one spinning against it on the same cores.
try:
    import ggml as _ggml
    from ggml import utils as _ggml_utils
except ImportError:  # the optional `ggml` extra is not installed: fbgemm serves every row
    _ggml = None
    _ggml_utils = None

_log = logging.getLogger("ggml")
# ggml's log levels (ggml.h) as Python's: its per-tensor notes (e.g. each weight repacked at load) are debug.
_LEVELS = {1: logging.DEBUG, 2: logging.DEBUG, 3: logging.WARNING, 4: logging.ERROR}


def _forward_log(level: int, text: bytes | None, _: Any) -> None:
    message = (text or b"").decode("utf-8", "replace").rstrip()
    if message:
        _log.log(_LEVELS.get(level, logging.DEBUG), "%s", message)


if _ggml is not None:  # ggml writes to stderr unless given a callback; kept referenced for the process's life
    _LOG_CALLBACK = _ggml.ggml_log_callback(_forward_log)
    _ggml.ggml_log_set(_LOG_CALLBACK, None)

LAYER_MAX_ROWS = 16  # a decoder layer's products: ggml up to this many rows (tokens in the step), fbgemm past it
_STATUS_SUCCESS = 0
_BLOCK = 32  # values in a Q8_0 block: a product's input rows lie this many values apart (RowKernel dot_products)
# ggml's runtime is process-wide and its compute is not re-entrant: one call at a time (the engine thread's).
# Re-entrant: a row kernel holds it across its shared input/output buffers and the compute inside.
_compute_lock = threading.RLock()


def ggml_modules() -> tuple[Any, Any]:
    """The ggml bindings and their utils; raises RuntimeError where the `ggml` extra is not installed."""
    if _ggml is None or _ggml_utils is None:
        raise RuntimeError("the ggml package is not installed (pip install 'corral[ggml]')")
    return _ggml, _ggml_utils


@dataclass(frozen=True)
class QuantBlocks:
    """A weight as ggml stores it quantized: rows of blocks (Q8_0, Q4_K, ...) as raw bytes."""

    data: np.ndarray  # uint8 [out_features, bytes per row]
    ggml_type: int
    type_name: str
    out_features: int
    in_features: int


def ggml_function(name: str, result: Any, *arguments: Any) -> Any:
    """A ggml function through ctypes with the given result and argument types: the bindings declare some pointer
    results as int, which cuts them to 32 bits (a crash on first use), and leave newer functions undeclared."""
    ggml, _ = ggml_modules()
    function = getattr(ggml.lib, name)
    function.restype, function.argtypes = result, list(arguments)
    return function


def cpu_buffer_type() -> Any:
    """ggml's CPU buffer type, for its graph allocator."""
    return ggml_function("ggml_backend_cpu_buffer_type", ctypes.c_void_p)()


class GraphPlan:
    """A ggml graph with its compute plan per thread count (and the work buffer each plan points at)."""

    def __init__(self, graph: Any) -> None:
        self.graph = graph
        self._plans: dict[int, tuple[Any, np.ndarray]] = {}

    def compute(self, threads: int) -> None:
        """Compute the graph on `threads` threads, one graph at a time in the process."""
        with _compute_lock:
            if threads not in self._plans:
                plan = _ggml.ggml_graph_plan(self.graph, threads, None)
                work = np.zeros(max(int(plan.work_size), 1), dtype=np.uint8)
                plan.work_data = work.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
                self._plans[threads] = (plan, work)  # the buffer lives as long as the plan that points at it
            status = _ggml.ggml_graph_compute(self.graph, ctypes.byref(self._plans[threads][0]))
        if status != _STATUS_SUCCESS:
            raise RuntimeError(f"ggml's graph compute failed (status {status})")


def _switch() -> str:
    return chosen_kernels().row_kernel


def row_kernel_available() -> bool:
    """Whether fp16 products of few rows go to ggml: the package is installed and the switch does not say torch."""
    return _ggml is not None and _switch() != "torch"


def llamafile_built() -> bool:
    """Whether the installed ggml multiplies through llamafile's tinyBLAS tiles, as llama.cpp builds it
    (`make install` builds it so; the package's own build leaves it off). On an AMD EPYC (AVX2) it makes ggml's
    products of several rows much faster, one row level (measured:
    docs/models.md#weight-only-quantization---quantization)."""
    return _ggml is not None and bool(_ggml.ggml_cpu_has_llamafile())


# The ggml that llama.cpp (llama-cpp-python 0.3.36) carries, which `make install` builds (deploy/ggml/build-ggml.sh);
# ggml-python's own is 0.15: its prompts through K-quant weights that are not repacked (Q6_K) ran ~1.3x slower.
LLAMA_CPP_GGML = (0, 25)


def ggml_version() -> tuple[int, ...]:
    """The installed ggml library's version, e.g. (0, 25, 3); () without ggml or where it does not say."""
    if _ggml is None:
        return ()
    text = (ggml_function("ggml_version", ctypes.c_char_p)() or b"").decode("ascii", "replace")
    try:
        return tuple(int(part) for part in text.split("."))
    except ValueError:
        return ()


def layer_graphs_available() -> bool:
    """Whether steps of few tokens run their layers as ggml graphs (corral/kernels/ggml_layers.py): the row
    kernels are on and the switch does not say `products` (ggml for the products only, torch for the rest)."""
    return row_kernel_available() and _switch() != "products"


class _Shape:
    """The graph for one number of rows: its input and output in ggml's memory, seen as torch tensors, and
    its plans."""

    def __init__(
        self, weight: Any, in_features: int, out_features: int, rows: int, input_type: int, apart: bool = False
    ) -> None:
        """apart: the input's rows of blocks lie one block apart (see RowKernel's dot_products)."""
        gap = _BLOCK if apart else 0
        size = (in_features + gap + out_features) * rows * 4 + 4 * _ggml.ggml_tensor_overhead()
        size += _ggml.ggml_graph_overhead()
        self.ctx: Any = _ggml.ggml_init(_ggml.ggml_init_params(mem_size=size + 4096, mem_buffer=None, no_alloc=False))
        if not self.ctx:
            raise MemoryError(f"ggml could not allocate {size} bytes for a {rows}-row product")
        ggml_input = _ggml.ggml_new_tensor_2d(self.ctx, input_type, in_features + gap, rows)
        if input_type == _ggml.GGML_TYPE_F32:
            self.input = torch.from_numpy(_ggml_utils.to_numpy(ggml_input)).view(rows, in_features)
        else:  # the input's blocks as raw bytes, one row of blocks per input row
            row_bytes = int(_ggml.ggml_row_size(input_type, in_features))
            stride = int(_ggml.ggml_row_size(input_type, in_features + gap))
            raw = (ctypes.c_uint8 * (stride * rows)).from_address(_ggml.ggml_get_data(ggml_input))
            self.input = torch.frombuffer(raw, dtype=torch.uint8).view(rows, stride)[:, :row_bytes]
            if gap:
                ggml_input = _ggml.ggml_view_2d(self.ctx, ggml_input, in_features, rows, stride, 0)
        ggml_output = _ggml.ggml_mul_mat(self.ctx, weight, ggml_input)  # the weight lives in the kernel's context
        self._output = ggml_output.contents  # its data pointer is each call's own result tensor (`product`)
        self.rows, self.out_features = rows, out_features
        graph = _ggml.ggml_new_graph(self.ctx)
        _ggml.ggml_build_forward_expand(graph, ggml_output)
        self.plan = GraphPlan(graph)

    def product(self, threads: int) -> torch.Tensor:
        """Compute into a new tensor: ggml writes the result where the output's data pointer says, so pointing
        it at a fresh tensor saves copying the result out of ggml's memory (Gemma 3's head: 1 MB a row, ~1 % of
        its decode step)."""
        result = torch.empty(self.rows, self.out_features)
        self._output.data = result.data_ptr()
        self.plan.compute(threads)
        return result

    def free(self) -> None:
        if self.ctx:
            _ggml.ggml_free(self.ctx)
            self.ctx = None


class GgmlWeight(Protocol):
    """A weight ggml already holds (a GGUF's tensor over its memory map: corral/server/models/gguf_file.py)."""

    @property
    def ggml_weight(self) -> Any: ...
    @property
    def ggml_type(self) -> int: ...
    @property
    def in_features(self) -> int: ...
    @property
    def out_features(self) -> int: ...


class RowKernel:
    """y = x Wᵀ for x [rows, in_features] (float32, 1 <= rows <= max_rows), W held by ggml in fp16. Owns its
    ggml contexts: the weight's, and one small one per number of rows it has served."""

    def __init__(
        self, weight: torch.Tensor | QuantBlocks | GgmlWeight, max_rows: int = 1, input_blocks: bool = False,
        dot_products: bool = False,
    ) -> None:
        """weight: a float weight [out_features, in_features], held in fp16; or a GGUF's quantized blocks,
        held as they are (ggml then rounds the input to its 8-bit dot-product type, as llama.cpp does); or a
        tensor ggml holds already, used where it lies. input_blocks: Q8_0 weights take their input already in
        Q8_0 blocks (raw bytes [rows, row bytes]), as the caller rounded it, instead of float32 for ggml to
        round. dot_products (with input_blocks): the input's rows lie one block apart in ggml's memory, which
        llamafile's tiles do not take, so ggml multiplies with its own dot product per row and column: faster
        for 3-9 rows of Gemma 3's head on an AMD EPYC (docs/measured-choices.md#q8_0-products-of-few-rows)."""
        if _ggml is None or _ggml_utils is None:
            raise RuntimeError("the ggml package is not installed (pip install 'corral[ggml]')")
        if dot_products and not input_blocks:
            raise ValueError("dot_products takes the input as blocks (input_blocks)")
        self._shapes: dict[int, _Shape] = {}
        self._ctx: Any = None  # the weight's own context (none for a weight ggml already holds)
        self._apart = dot_products
        if not isinstance(weight, torch.Tensor | QuantBlocks):
            self.out_features, self.in_features, self.max_rows = weight.out_features, weight.in_features, max_rows
            if input_blocks and weight.ggml_type != _ggml.GGML_TYPE_Q8_0:
                raise ValueError("only Q8_0 weights take their input as blocks")
            self._input_type = _ggml.GGML_TYPE_Q8_0 if input_blocks else _ggml.GGML_TYPE_F32
            self._weight = weight.ggml_weight
            return
        if isinstance(weight, QuantBlocks):
            out_features, in_features, kind = weight.out_features, weight.in_features, weight.ggml_type
        else:
            out_features, in_features = (int(d) for d in weight.shape)
            kind = _ggml.GGML_TYPE_F16
        self.out_features, self.in_features, self.max_rows = out_features, in_features, max_rows
        if input_blocks and kind != _ggml.GGML_TYPE_Q8_0:
            raise ValueError("only Q8_0 weights take their input as blocks")
        self._input_type = _ggml.GGML_TYPE_Q8_0 if input_blocks else _ggml.GGML_TYPE_F32
        size = int(_ggml.ggml_row_size(kind, in_features)) * out_features + _ggml.ggml_tensor_overhead() + 4096
        self._ctx = _ggml.ggml_init(_ggml.ggml_init_params(mem_size=size, mem_buffer=None, no_alloc=False))
        if not self._ctx:
            raise MemoryError(f"ggml could not allocate {size} bytes for a {out_features} x {in_features} weight")
        self._weight = _ggml.ggml_new_tensor_2d(self._ctx, kind, in_features, out_features)
        if isinstance(weight, QuantBlocks):
            if int(_ggml.ggml_nbytes(self._weight)) != weight.data.nbytes:
                raise ValueError(f"{weight.type_name} blocks of {weight.data.nbytes} bytes do not fill a "
                                 f"{out_features} x {in_features} weight")
            ctypes.memmove(_ggml.ggml_get_data(self._weight), np.ascontiguousarray(weight.data).ctypes.data,
                           weight.data.nbytes)
        else:
            torch.from_numpy(_ggml_utils.to_numpy(self._weight)).copy_(weight.detach().to(torch.float16))

    def takes(self, rows: int) -> bool:
        return 1 <= rows <= self.max_rows

    @property
    def ggml_weight(self) -> Any:
        """The fp16 weight as a ggml tensor [in_features, out_features], for graphs that multiply by it."""
        return self._weight

    def for_rows(self, rows: int) -> Any:
        """The weight a graph's product of `rows` rows multiplies by: the same for any rows."""
        return self._weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, out_features] float32 for x [rows, in_features] (or, for `input_blocks`, x's Q8_0 bytes), on as
        many threads as torch uses here."""
        rows = int(x.shape[0])
        if not self.takes(rows):
            raise ValueError(f"this kernel takes 1 to {self.max_rows} rows, not {rows}")
        threads = max(1, torch.get_num_threads())
        with _compute_lock:
            shape = self._shapes.get(rows)
            if shape is None:
                shape = self._shapes[rows] = _Shape(self._weight, self.in_features, self.out_features, rows,
                                                     self._input_type, self._apart)
            shape.input.copy_(x)
            return shape.product(threads)

    def __del__(self) -> None:
        if _ggml is None:
            return
        for shape in getattr(self, "_shapes", {}).values():
            shape.free()
        ctx = getattr(self, "_ctx", None)
        if ctx:
            _ggml.ggml_free(ctx)
