"""Which CPU kernels a decode step uses, as one object set from the server's settings (`--row-kernel`,
`--head-screen`, or `CORRAL_ROW_KERNEL` / `CORRAL_HEAD_SCREEN` through them): no kernel module reads the
environment itself.

The choice is process-wide, like the kernels it picks between (ggml's CPU backend is one per process); `load_model`
sets it before it builds a decoder, so a model's projections and head are built under one choice. The defaults
are the measured best (docs/models.md); the other values exist for comparisons.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

RowKernel = Literal["ggml", "products", "torch"]


@dataclass(frozen=True)
class KernelOptions:
    # ggml: fp16 products of few rows and whole decode steps of few tokens on ggml (where the `ggml` extra is
    # installed); products: ggml for the products only, the layers' small ops in torch; torch: no ggml.
    row_kernel: RowKernel = "ggml"
    # Greedy rows' fp16 head through an integer screen with error bounds (corral/kernels/head_screen.py).
    head_screen: bool = True


_chosen = KernelOptions()


def use_kernels(options: KernelOptions) -> None:
    """Choose the kernels decoders built from now on use (load_model, from the settings)."""
    global _chosen
    _chosen = options


def chosen_kernels() -> KernelOptions:
    return _chosen
