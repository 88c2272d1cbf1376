"""A linear projection whose weight is prepacked for oneDNN on CPU, where that was measured to be faster.

torch's CPU `F.linear` goes through MKL's sgemm. The same product through oneDNN, with the weight reordered once
into its blocked layout, took less than half the time for the default model's 128,257 × 64 vocabulary projection
at 8 rows, and less for a Llama-3.2-1B-shaped layer's projections (`corral bench projection`; measured:
docs/measured-choices.md#projections). vLLM's CPU backend takes the same route (oneDNN, prepacked) for the same
reason.

Two cases stay on `F.linear`, both measured: small weights, where oneDNN's fixed cost per call is more than the
product itself, and a single float32 row through a weight with a short input axis (the default model's head at
batch 1). The packed path gives a row the same result
whatever else is in the batch (its rows are computed independently); the single-row plain path differs from
it by float32 rounding only.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# Below this many weight elements oneDNN's per-call overhead is larger than what its kernel saves.
PACK_MIN_ELEMENTS = 1 << 18
# A float32 single row through a weight with fewer input features than this is faster unpacked.
_PLAIN_SINGLE_ROW_MAX_IN = 256
_PACKED_DTYPES = (torch.float32, torch.bfloat16)


def _pack(weight: torch.Tensor, min_elements: int) -> torch.Tensor | None:
    """The oneDNN-blocked copy of `weight`, or None where packing does not apply or pay."""
    if weight.device.type != "cpu" or weight.dtype not in _PACKED_DTYPES or weight.numel() < min_elements:
        return None
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return None
    # The batch-size hint only tunes the blocking; the packed weight serves any number of rows. Measured
    # (`corral bench projection`, docs/measured-choices.md#projections): a long input axis wants hint 1, a short
    # one (the default model's head) wants 8, and its single rows go unpacked.
    hint = 8 if weight.shape[1] < _PLAIN_SINGLE_ROW_MAX_IN else 1
    try:
        packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), hint)
    except (RuntimeError, AttributeError) as exc:  # a torch build without the op: plain is still correct
        log.info("oneDNN weight packing unavailable (%s); using F.linear", exc)
        return None
    return packed


class Projection:
    """y = x Wᵀ + b for x [..., in_features]. Holds the weight it needs: the packed copy, the plain one, or both."""

    __slots__ = ("_bias", "_packed", "_plain", "_single_row_plain", "in_features", "out_features")

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        min_pack_elements: int | None = None,
        keep_plain: bool = False,
    ) -> None:
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self._bias = bias
        threshold = PACK_MIN_ELEMENTS if min_pack_elements is None else min_pack_elements
        self._packed = _pack(weight, threshold)
        keep_plain = keep_plain or self._packed is None
        self._single_row_plain = weight.dtype == torch.float32 and self.in_features < _PLAIN_SINGLE_ROW_MAX_IN
        # Dropping the plain weight once packed keeps the model's memory what it was.
        self._plain = weight if keep_plain or self._single_row_plain else None

    @property
    def packed(self) -> bool:
        return self._packed is not None

    @property
    def holds_plain(self) -> bool:
        """Whether the unpacked weight is kept (no packing, the single-row path, or asked for: `select`)."""
        return self._plain is not None

    def uses_packed(self, rows: int) -> bool:
        """Whether a call with this many rows goes through oneDNN's packed weight."""
        return self._packed is not None and not (self._single_row_plain and rows == 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        packed = self._packed
        if packed is None or (self._single_row_plain and x.numel() == self.in_features):
            assert self._plain is not None
            return F.linear(x, self._plain, self._bias)
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, self._bias, "none", [], "")
        return out

    def select(self, x: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        """Only the outputs (rows[i], columns[i]) of x Wᵀ + b, for x [R, in_features]: [len(rows)] values.
        Needs the plain weight (`keep_plain`): a grammar that allows 200 of 128,257 tokens needs 200 dot
        products, not the whole vocabulary projection."""
        assert self._plain is not None, "select needs the plain weight: build the projection with keep_plain"
        values = (self._plain.index_select(0, columns) * x.index_select(0, rows)).sum(-1)
        return values if self._bias is None else values + self._bias.index_select(0, columns)
