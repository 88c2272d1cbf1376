"""Whether this ggml build adds up half-precision products in half precision.

ggml compiled for a CPU with AVX512-FP16 (Intel Sapphire Rapids and later; a `-march=native` build there, as
the ggml package's own is) computes its float16 dot products with float16 multiply-adds and float16 sums.
Flash attention over a float16 KV cache takes its q·k scores from those dot products. A model with large keys
(Qwen2.5's layer 0: scores of ~87,000 before the 1/sqrt(d) scale) overflows float16's 65,504 to infinity, and two
infinite scores make the softmax NaN: a head's output, then everything after it, is wrong (measured on an Intel
Xeon, 2026-11-29: docs/measured-choices.md#half-precision-sums). Below the overflow the sums still round to
float16's 11 bits. `make install` builds ggml with `-mno-avx512fp16`, so its sums are float32; a build that
still sums in float16 is found here, and a GGUF decoder then keeps its KV cache in float32, whose attention
sums in float32.
"""

from __future__ import annotations

import functools
import logging
import math

import numpy as np

from corral.kernels.row_kernel import GraphPlan, ggml_modules

log = logging.getLogger(__name__)

_DIM = 128
_VALUE = 32.0  # q·k = 128 * 32 * 32 = 131,072: finite in float32, infinite in float16


@functools.cache
def attention_sums_in_half() -> bool:
    """Whether ggml's flash attention over float16 keys and values sums its scores in float16 (overflowing where
    float32 would not). One query against two equal keys whose unscaled score is twice float16's largest value;
    the values 1 and 2 then average to 1.5 exactly when the sums are float32. Checked once per process."""
    ggml, utils = ggml_modules()
    size = 16 * _DIM * 4 + 8 * int(ggml.ggml_tensor_overhead()) + int(ggml.ggml_graph_overhead()) + 4096
    ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=size, mem_buffer=None, no_alloc=False))
    if not ctx:
        raise MemoryError("ggml could not allocate the half-precision check's few KB")
    try:
        query = ggml.ggml_new_tensor_4d(ctx, ggml.GGML_TYPE_F32, _DIM, 1, 1, 1)
        keys = ggml.ggml_new_tensor_4d(ctx, ggml.GGML_TYPE_F16, _DIM, 2, 1, 1)
        values = ggml.ggml_new_tensor_4d(ctx, ggml.GGML_TYPE_F16, _DIM, 2, 1, 1)
        utils.to_numpy(query)[...] = _VALUE
        utils.to_numpy(keys)[...] = np.float16(_VALUE)
        filled = utils.to_numpy(values)
        filled[...] = np.float16(1.0)
        filled.reshape(-1, _DIM)[1] = np.float16(2.0)
        scale = 1.0 / (_DIM * _VALUE * _VALUE)  # both scores 1.0 once scaled
        out = ggml.ggml_flash_attn_ext(ctx, query, keys, values, None, scale, 0.0, 0.0)
        graph = ggml.ggml_new_graph(ctx)
        ggml.ggml_build_forward_expand(graph, out)
        GraphPlan(graph).compute(1)
        result = utils.to_numpy(out).reshape(-1)
        right = all(math.isfinite(float(x)) and abs(float(x) - 1.5) < 1e-2 for x in result)
    finally:
        ggml.ggml_free(ctx)
    if not right:
        log.warning(
            "this ggml build sums float16 products in float16 (AVX512-FP16): attention over a float16 KV cache "
            "overflows on models with large keys, so GGUF models keep a float32 KV cache (twice the memory); "
            "rebuild ggml with -mno-avx512fp16 as `make install` does to use float16"
        )
    return not right
