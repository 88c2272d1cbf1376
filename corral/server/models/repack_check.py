"""Whether ggml's repacked weights give a GGUF decoder the logits of the file's own blocks on this CPU.

ggml repacks some quantized types (Q4_0, Q4_K, IQ4_NL) into interleaved layouts for its GEMM/GEMV kernels, as
llama.cpp does at load (corral/server/models/gguf_file.py). Those kernels are chosen per instruction set, so a
repacked decoder is believed only once short prompts give it the logits of the same file served where its
blocks lie (corral/server/models/gguf_decoder.py tries every layer weight, then the MLP's alone, then none).
The probe caught one real fault (an Intel Xeon, 2026-11-29): Qwen2.5-Coder 1.5B's repacked blocks gave logits off
by half their scale and answered "Name three colours." with noise. The kernels were right; ggml's attention had
summed float16 scores in float16 and made one head NaN. The unrepacked o projection's 8-bit rounding of that row
turned it into finite wrong values; the repacked one passed the NaN on (corral/kernels/half_sums.py: the cause
and its fix).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from corral.kernels.decode_layout import DecodeLayout, LongRow, StepRows
from corral.server.models.decoder_config import DecoderShape

PROBE_TOKENS = 16
# Logits a repacked decoder may differ from the plain one by, as a fraction of their scale at any probe position.
# Right kernels sum in another order and round the input to 8 bits at other places: on Gemma 3 270M the two
# differed by up to ~0.15 (each as far from the float16 model's logits as the other), on Qwen2.5 by ~0.05. The
# wrong kernels were off by the scale itself (1.0) from a few tokens into a prompt of common tokens.
TOLERANCE = 0.4


class ProbedDecoder(Protocol):
    """What the probe reads of a GGUF decoder (corral/server/models/gguf_decoder.py)."""

    shape: DecoderShape
    kv_dtype: torch.dtype

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, last: torch.Tensor, attend: Any) -> Any: ...


class _ProbeCache:
    """A KV cache of one slot holding one prompt: the step is that prompt as one long row (DecodeCache)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, tokens: int, dtype: torch.dtype) -> None:
        self.max_len = tokens
        self.keys = [torch.zeros(1, tokens, kv_heads, head_dim, dtype=dtype) for _ in range(layers)]
        self.values = [torch.zeros(1, tokens, kv_heads, head_dim, dtype=dtype) for _ in range(layers)]
        self._tokens = tokens

    def decode_layout(self) -> DecodeLayout | None:
        return None

    def step_rows(self) -> StepRows:
        return StepRows(None, (LongRow(offset=0, tokens=self._tokens, slot=0, start=0),))


def _probe_prompts(vocab: int) -> list[torch.Tensor]:
    """Pseudo-random tokens, and a run of consecutive ids low in the vocabulary (common pieces: where the wrong
    kernels showed most)."""
    low = min(200, max(0, vocab - PROBE_TOKENS))
    return [
        torch.randint(0, vocab, (PROBE_TOKENS,), generator=torch.Generator().manual_seed(0)),
        torch.arange(low, low + PROBE_TOKENS),
    ]


def probe_logits(decoder: ProbedDecoder, ids: torch.Tensor) -> torch.Tensor:
    """The decoder's logits at every token of a prompt, from an empty cache."""
    shape, tokens = decoder.shape, len(ids)
    cache = _ProbeCache(shape.num_layers, shape.num_kv_heads, shape.head_dim, tokens, decoder.kv_dtype)
    positions = torch.arange(tokens)
    with torch.inference_mode():
        logits: torch.Tensor = decoder(ids, positions, positions, cache)
    return logits.float()


def repacked_agree(repacked: ProbedDecoder, plain: ProbedDecoder, vocab: int) -> tuple[bool, float]:
    """Whether the repacked decoder's logits are the plain one's within TOLERANCE of their scale at every
    position of the probe prompts, and the largest gap as that fraction."""
    worst = 0.0
    for ids in _probe_prompts(vocab):
        ours, theirs = probe_logits(repacked, ids), probe_logits(plain, ids)
        if not bool(torch.isfinite(ours).all()):
            return False, float("inf")
        gaps = (ours - theirs).abs().amax(-1) / theirs.abs().amax(-1).clamp_min(1e-6)
        worst = max(worst, float(gaps.max()))
    return worst <= TOLERANCE, worst
