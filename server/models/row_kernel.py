"""A single row through an fp16 weight, on ggml's CPU kernels: the decode step at concurrency 1.

One row reads every weight once for one dot product per output, so a projection there costs what its weight
costs to read, if the kernel keeps up with the memory. fbgemm's fp16 kernel (`quantized.linear_dynamic_fp16`,
what corral's fp16 projections use) does not at one row on an AVX2 CPU: Gemma 3 270M's 72 layer projections
(201 MB) in 11.0 ms, 18 GB/s, on two cores that stream 28-30 GB/s. ggml, llama.cpp's tensor library (through
the `ggml-python` bindings, the `ggml` extra), multiplies the same fp16 weights at 29 GB/s: 6.9 ms for those
projections and 11.6 ms for the 335 MB head against fbgemm's 16-18 (measured on this machine's EPYC, both on two
threads; docs/serving-benchmark.md). Several rows stay with fbgemm, whose kernel reuses each weight it reads
across them.

ggml's F16 dot product takes its input in fp16 too (as llama.cpp computes an F16 model), so a row's outputs are
rounded a little against fbgemm's (float32 input): the head reports `rounds_outputs` and the logits that decide
a pick are recomputed exactly (server/models/logit_refinement.py), so one row and several agree on the choice.

`CORRAL_ROW_KERNEL=torch` turns it off (for comparisons); without the `ggml` package it is off.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

_ggml: Any
_ggml_utils: Any
try:
    import ggml as _ggml
    from ggml import utils as _ggml_utils
except ImportError:  # the optional `ggml` extra is not installed: fbgemm serves every row
    _ggml = None
    _ggml_utils = None

SWITCH_ENV = "CORRAL_ROW_KERNEL"  # "ggml" (the default where installed) or "torch"
_STATUS_SUCCESS = 0
# ggml's runtime is process-wide and its compute is not re-entrant: one call at a time (the engine thread's).
_compute_lock = threading.Lock()


def row_kernel_available() -> bool:
    """Whether one-row fp16 products go to ggml: the package is installed and the switch does not say torch."""
    return _ggml is not None and os.environ.get(SWITCH_ENV, "ggml").strip().lower() != "torch"


class RowKernel:
    """y = x Wᵀ for x [1, in_features] (float32), W held by ggml in fp16. Owns its ggml context."""

    def __init__(self, weight: torch.Tensor) -> None:
        if _ggml is None or _ggml_utils is None:
            raise RuntimeError("the ggml package is not installed (pip install 'corral[ggml]')")
        out_features, in_features = (int(d) for d in weight.shape)
        self.out_features, self.in_features = out_features, in_features
        size = (
            out_features * in_features * 2
            + (in_features + out_features) * 4
            + 4 * _ggml.ggml_tensor_overhead()
            + _ggml.ggml_graph_overhead()
            + 4096
        )
        params = _ggml.ggml_init_params(mem_size=size, mem_buffer=None, no_alloc=False)
        self._ctx: Any = _ggml.ggml_init(params)
        if not self._ctx:
            raise MemoryError(f"ggml could not allocate {size} bytes for a {out_features} x {in_features} weight")
        ggml_weight = _ggml.ggml_new_tensor_2d(self._ctx, _ggml.GGML_TYPE_F16, in_features, out_features)
        # ggml's memory seen as torch tensors: the weight is written once, the input and output every call.
        torch.from_numpy(_ggml_utils.to_numpy(ggml_weight)).copy_(weight.detach().to(torch.float16))
        ggml_input = _ggml.ggml_new_tensor_2d(self._ctx, _ggml.GGML_TYPE_F32, in_features, 1)
        ggml_output = _ggml.ggml_mul_mat(self._ctx, ggml_weight, ggml_input)
        self._input = torch.from_numpy(_ggml_utils.to_numpy(ggml_input)).view(1, in_features)
        self._output = torch.from_numpy(_ggml_utils.to_numpy(ggml_output)).view(1, out_features)
        self._graph = _ggml.ggml_new_graph(self._ctx)
        _ggml.ggml_build_forward_expand(self._graph, ggml_output)
        self._plans: dict[int, tuple[Any, np.ndarray]] = {}  # per thread count: (plan, its work buffer)

    def _plan(self, threads: int) -> Any:
        if threads not in self._plans:
            assert _ggml is not None
            plan = _ggml.ggml_graph_plan(self._graph, threads, None)
            work = np.zeros(max(int(plan.work_size), 1), dtype=np.uint8)
            plan.work_data = work.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
            self._plans[threads] = (plan, work)  # the buffer lives as long as the plan that points at it
        return self._plans[threads][0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """[1, out_features] float32 for x [1, in_features], on as many threads as torch uses here."""
        assert _ggml is not None
        threads = max(1, torch.get_num_threads())
        with _compute_lock:
            plan = self._plan(threads)
            self._input.copy_(x)
            status = _ggml.ggml_graph_compute(self._graph, ctypes.byref(plan))
            if status != _STATUS_SUCCESS:
                raise RuntimeError(f"ggml's matmul failed (status {status})")
            return self._output.clone()

    def __del__(self) -> None:
        ctx = getattr(self, "_ctx", None)
        if ctx and _ggml is not None:
            _ggml.ggml_free(ctx)
