"""Integer screens in front of the fp16 head, for rows that need only their best token.

Gemma 3's head is 262,144 × 640: under `fp16` it is 335 MB a step, and at 8 rows fbgemm's fp16 product is bound by
arithmetic (half a decode step; measured: docs/measured-choices.md#head-screens). An 8-bit integer product reads
half the bytes, but its rounding is coarse on Gemma's hidden states (a few dimensions reach ~70 where most stay
under ~9): fbgemm's integer head's argmax differed from fp16's at 14 % of positions of real text
(docs/changelog.md, fourteenth). So it only screens. A greedy row that reports nothing (no logprobs, penalties or
biases) needs only the token with the highest logit, and a screen proves which tokens can be it:

- every screened logit comes with a strict bound on its error, per token j: the L2 norm of row j's weight
  rounding × the input's, plus the L2 norm of the input's rounding (known exactly: the rounding is done here)
  × row j's weights' (Cauchy-Schwarz on both terms), plus float32's rounding;
- after the step's masks, only tokens whose screened logit plus bound reaches the best token's screened logit
  minus its bound can have the best exact logit: those few are computed exactly from the fp16 weights
  (`select`, as a grammar-restricted row's are), and the pick is the fp16 head's. A row with more than
  `MAX_CANDIDATES` of them gets its full fp16 row instead.

Two screens, by the step's number of screened rows:
- one row: ggml's 8-bit block product (corral/kernels/block_screen.py), the input rounded per 32 values;
- several: `HeadScreen`, fbgemm's integer product, which reads each weight once for all the rows. Each row is
  rounded to 8 bits with its own step, and the `OUTLIER_DIMS` input dimensions that run largest (found once at
  load, `calibrated_screen`) are left out of it and added in float32. Only where fbgemm's 8-bit sums are exact
  (VNNI's 32-bit sums): on AVX2 it must round inputs to 7 bits, and then its bounds let through a median of 17
  and a 90th percentile of 5,535 candidates a row on real text (against 3 and 38 for the block screen), and
  serving 8 streams of Gemma 3 with it on an AMD EPYC was slower than without
  (docs/models.md#weight-only-quantization---quantization).

Sampled rows, rows that report logprobs, and rows picked before their mask (lazy masks) keep the fp16 head.
`--no-head-screen` (`CORRAL_HEAD_SCREEN=off`) serves every row through the fp16 head (for comparisons).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from corral.kernels.choice import chosen_kernels
from corral.kernels.quantized_projection import prepack_w8a8

log = logging.getLogger(__name__)

OUTLIER_DIMS = 16  # input dimensions computed in float32 beside the integer product
# A row with more candidates than this (a flat distribution) is computed in full: its exact values via `select`
# would read more than the head's fp16 row does.
MAX_CANDIDATES = 8192
_SLACK_ABS = 2e-2  # added to every bound, beside `HeadScreen.rounding_per_l1` of the input's L1 norm
_CHUNK = 16384  # head rows quantized at a time (bounds the float32 temporaries at load)
CALIBRATION_TOKENS = 48


def head_screen_enabled() -> bool:
    return chosen_kernels().head_screen


class Screen(Protocol):
    """A screen of one fp16 head: approximate logits, and per token what their bounds are made of."""

    error_norms: torch.Tensor  # [V] L2 norm of each token's weights' rounding (times the input's norm)
    rounded_norms: torch.Tensor  # [V] L2 norm of the weights the input's rounding meets (times its norm)
    rounding_per_l1: float

    @property
    def weight_bytes(self) -> int: ...

    def logits(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def slack(self, input_l1: torch.Tensor) -> torch.Tensor: ...


def float_rounding_per_l1(weight: torch.Tensor) -> float:
    """float32's rounding in a sum of n products, in a screen and in `select`, is at most ~n·2⁻²⁴ of Σ|xᵢ·wᵢⱼ|,
    itself at most the input's L1 norm times the largest weight: twice that, per unit of the input's L1 norm."""
    return int(weight.shape[1]) * 2.0**-23 * float(weight.detach().abs().max())


def float_slack(rounding_per_l1: float, input_l1: torch.Tensor) -> torch.Tensor:
    """float32's rounding in a screened logit and in its exact value, for inputs of these L1 norms."""
    return _SLACK_ABS + rounding_per_l1 * input_l1


class HeadScreen:
    """The integer screen of one fp16 head [vocab, in_features] (its weights as the fp16 head holds them), for
    steps of several rows. Raises ValueError where fbgemm's 8-bit integer sums are not exact."""

    def __init__(self, weight: torch.Tensor, outliers: torch.Tensor) -> None:
        # 8-bit inputs need fbgemm's integer sums exact at full range (VNNI's 32-bit sums); AVX2 adds pairs of
        # u8 × s8 products in 16 bits, which full-range inputs overflow. The bounds rest on it.
        if not exact_product(int(weight.shape[1])):
            raise ValueError("fbgemm's 8-bit integer sums are not exact on this CPU (AVX2 without VNNI)")
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self.outliers = outliers.to(torch.long)
        self._inside = torch.ones(self.in_features, dtype=torch.float32)
        self._inside[self.outliers] = 0.0
        vocab = self.out_features
        self._outlier_weight = torch.empty(vocab, len(self.outliers))  # [V, k] float32
        codes = torch.empty(vocab, self.in_features, dtype=torch.int8)
        scales = torch.empty(vocab)
        self.error_norms = torch.empty(vocab)  # L2 norm of each row's rounding error
        self.rounded_norms = torch.empty(vocab)  # L2 norm of each row as rounded
        for lo in range(0, vocab, _CHUNK):
            w = weight[lo : lo + _CHUNK].detach().float().half().float()  # the values fp16's kernels compute with
            self._outlier_weight[lo : lo + len(w)] = w[:, self.outliers]
            w *= self._inside  # the integer product covers the other dimensions only
            scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
            code = torch.round(w / scale[:, None]).clamp(-127, 127)
            rounded = code * scale[:, None]
            codes[lo : lo + len(w)] = code.to(torch.int8)
            scales[lo : lo + len(w)] = scale
            self.error_norms[lo : lo + len(w)] = (w - rounded).norm(dim=1)
            self.rounded_norms[lo : lo + len(w)] = rounded.norm(dim=1)
        self._packed = prepack_w8a8(codes, scales)
        self.rounding_per_l1 = float_rounding_per_l1(weight)
        # Two outlier dimensions (zero weights in the pack) carry the grid's ends, so that fbgemm's rounding of
        # the call's input, whose step and zero point it takes from the input's range, keeps it as it is.
        self._pins = self.outliers[:2]

    @property
    def weight_bytes(self) -> int:
        """Bytes one screened call reads: the int8 codes, their scales and the float32 outlier columns."""
        return self.out_features * (self.in_features + 4 + 4 * len(self.outliers))

    def logits(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Screened logits [R, V] of x [R, in_features]; for each row, the L2 norms of its input over the
        dimensions the integer product covers and of that input's rounding. Each row is rounded here to
        integers in -127..127 with its own step, so its rounding error is known exactly.
        fbgemm's dynamic linear rounds a call's input to 0..255 with one step and zero point from its
        range: with two zero-weight dimensions pinned at -127 and 128 that range gives a step of
        exactly 1, so the integers pass through unchanged, and the product is exact integer sums times each
        row's scale."""
        x = x.float()
        inner = x * self._inside
        step = inner.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0
        codes = torch.round(inner / step)
        codes[:, self._pins[0]] = -127.0
        codes[:, self._pins[1]] = 128.0
        product: torch.Tensor = torch.ops.quantized.linear_dynamic(codes, self._packed, False)
        codes[:, self._pins] = 0.0
        product.mul_(step).addmm_(x[:, self.outliers], self._outlier_weight.t())
        return product, inner.norm(dim=1), (inner - codes * step).norm(dim=1)

    def bounds(self, input_norm: float, error_norm: float, input_l1: float) -> torch.Tensor:
        """How far each screened logit of a row may be from its exact value [V]: the product's error is
        x·(w − ŵ) + (x − x̂)·ŵ, each term at most the product of two L2 norms (Cauchy-Schwarz), plus float32's
        rounding in both paths."""
        slack = self.slack(torch.tensor(input_l1))
        return self.error_norms * input_norm + self.rounded_norms * error_norm + slack

    def slack(self, input_l1: torch.Tensor) -> torch.Tensor:
        """float32's rounding, for inputs of these L1 norms."""
        return float_slack(self.rounding_per_l1, input_l1)


@dataclass(frozen=True)
class ScreenedRows:
    """The rows of a step's logits that came from a screen, with what their bounds need."""

    screen: Screen
    rows: list[int]
    input_norms: list[float]
    error_norms: list[float]
    input_l1: list[float]


class ExactHead(Protocol):
    """The fp16 head: full rows, and single outputs computed exactly in float32."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def select(self, x: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor: ...


def screen_rows(screen: Screen, hidden: torch.Tensor, rows: list[int], logits: torch.Tensor) -> ScreenedRows:
    """Write the screened logits of `rows` of hidden [B, in_features] into logits [B, V]."""
    index = torch.tensor(rows, dtype=torch.long)
    picked = hidden.index_select(0, index)
    values, input_norms, error_norms = screen.logits(picked)
    logits.index_copy_(0, index, values)
    l1 = picked.float().abs().sum(dim=1)
    return ScreenedRows(screen, rows, input_norms.tolist(), error_norms.tolist(), l1.tolist())


def settle_screened(
    head: ExactHead,
    logits: torch.Tensor,
    hidden: torch.Tensor,
    screened: ScreenedRows,
    wanted: Sequence[int],
) -> list[int]:
    """After the step's masks: each screened row of `wanted` gets its candidates' exact logits, so its best
    logit is the fp16 head's best allowed one. The best screened token k's exact logit is at least its value
    minus its bound; a token whose value plus bound is below that cannot be the best, and keeps its screened
    value (which is lower still). A row with too many candidates gets its whole fp16 row, masked as it was;
    those rows are returned, to be refined as any row the fp16 head computed."""
    screen = screened.screen
    wanted_rows = set(wanted)
    picked = [i for i, row in enumerate(screened.rows) if row in wanted_rows]
    if not picked:
        return []
    rows = torch.tensor([screened.rows[i] for i in picked], dtype=torch.long)
    norms = (screened.input_norms, screened.error_norms, screened.input_l1)
    input_norm, error_norm, input_l1 = (torch.tensor([values[i] for i in picked]) for values in norms)
    every = rows.tolist() == list(range(logits.shape[0]))
    lines = logits if every else logits.index_select(0, rows)  # [R, V], masked
    best = torch.from_numpy(lines.numpy().argmax(axis=1))  # numpy's: ~4x torch's max over [8, 262,144] here
    best_value = lines[torch.arange(len(rows)), best]
    finite = torch.isfinite(best_value)  # a row that allows nothing backs off: nothing to settle
    slack = screen.slack(input_l1)
    floor = best_value - (screen.error_norms[best] * input_norm + screen.rounded_norms[best] * error_norm + slack)
    # Every token's bound at once, then the ones that reach the floor: [R, V] in four passes.
    # (numpy's compare and flatnonzero: torch's nonzero over [8, 262,144] took ~10x as long.)
    reach = torch.outer(input_norm, screen.error_norms).addr_(error_norm, screen.rounded_norms).add_(lines)
    reach.add_(slack[:, None])
    threshold = torch.where(finite, floor, torch.tensor(float("inf"))).numpy()
    flat = torch.from_numpy(np.flatnonzero(reach.numpy() >= threshold[:, None]))
    width = lines.shape[1]
    local, ids = flat // width, flat % width
    counts = torch.bincount(local, minlength=len(picked))
    full = [int(rows[i]) for i in torch.nonzero(counts > MAX_CANDIDATES).flatten().tolist()]
    if full:
        crowded = torch.isin(local, torch.nonzero(counts > MAX_CANDIDATES).flatten())
        local, ids = local[~crowded], ids[~crowded]
        for row in full:
            exact = head(hidden[row : row + 1]).float()[0]
            logits[row] = exact.masked_fill_(logits[row] == float("-inf"), float("-inf"))
    if len(ids):
        logits[rows[local], ids] = head.select(hidden, rows[local], ids).float()
    return full


def calibrated_screen(
    weight: torch.Tensor, vocab: int, hidden_of: Callable[[torch.Tensor, Any], torch.Tensor], scale: float | None
) -> HeadScreen | None:
    """The screen of `weight`, its outlier dimensions found from the final hidden states the decoder gives a
    fixed run of pseudo-random tokens (`hidden_of(ids, attend)`, attention causal over the run itself): the
    dimensions that run large do so whatever the text (on Gemma 3, 10 of the 12 largest on prose were among the
    16 found this way). None where fbgemm's 8-bit integer sums are not exact (checked first)."""
    if not exact_product(int(weight.shape[1])):
        log.info("no integer screen for steps of several rows: fbgemm's 8-bit sums are not exact on this CPU")
        return None
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (CALIBRATION_TOKENS,), generator=generator)

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        group = q.shape[1] // k.shape[1]
        keys, values = (t.repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))
        out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, is_causal=True, scale=scale)
        return out.transpose(0, 1)

    hidden = hidden_of(ids, attend)[1:]  # the first position (an attention sink) never decodes
    try:
        return HeadScreen(weight, outlier_dims(hidden))
    except ValueError as exc:
        log.warning("no integer screen for the head: %s", exc)
        return None


def outlier_dims(hidden: torch.Tensor, count: int = OUTLIER_DIMS) -> torch.Tensor:
    """The `count` dimensions of final hidden states [T, in_features] that reach the largest magnitudes."""
    peaks = hidden.float().abs().amax(dim=0)
    return torch.topk(peaks, min(count, peaks.numel())).indices.sort().values


def exact_product(in_features: int) -> bool:
    """Whether fbgemm's dynamic linear, given 8-bit integer inputs with the pins `HeadScreen.logits` sets,
    returns their exact integer sums, at the values that overflow 16-bit pair sums (every input at the top of its
    range against weights of 127, and the opposite signs)."""
    codes = torch.full((4, in_features), 127, dtype=torch.int8)
    codes[2:] = -127
    codes[:, :2] = 0  # the pins' dimensions carry no weight
    packed = prepack_w8a8(codes, torch.ones(4))
    inputs = torch.full((2, in_features), 127.0)
    inputs[1] = -127.0
    inputs[:, 0], inputs[:, 1] = -127.0, 128.0
    expected = inputs.double() @ codes.double().t()
    got = torch.ops.quantized.linear_dynamic(inputs, packed, False)
    return bool(torch.equal(got.double(), expected))
