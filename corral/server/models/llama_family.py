"""corral's own decoder for the Llama family (Llama 2/3.x, Qwen2/2.5, Qwen3, Mistral) and Gemma 3, from safetensors.

All tokens of a step, from every row, are packed into one [T, hidden] batch: the projections, norms and MLP
run once for the whole step whatever the rows' lengths, and only attention needs to know which row a token
belongs to. That part is delegated to an `Attend` (the KV cache: corral/server/engine/kv_cache.py), so this module
holds only the arithmetic and runs unchanged on CPU and CUDA.

Configuration comes from transformers (AutoConfig), weights straight from the checkpoint's safetensors files.
Differences across the family are all data: Qwen2 has q/k/v biases (any bias in the checkpoint is used),
Qwen3 normalises q and k per head, Llama 3.1+ scales RoPE frequencies ("llama3"), heads may be grouped (GQA)
and the output head may be tied to the embedding. Gemma 3 is the same decoder with more data: the embedding is
scaled by sqrt(hidden), norms scale by (1 + weight) (folded into the weights at load), attention and MLP outputs
are normed too ("sandwich" norms), the MLP gate is GELU (tanh), queries are scaled by query_pre_attn_scalar, and
layers alternate between a sliding window and full attention, each kind with its own RoPE base. Sliding windows
are per layer (`DecoderShape.layer_windows`); the KV cache masks keys that left a layer's window.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from corral.kernels.ggml_graph_parts import StepShape
from corral.kernels.ggml_layers import GgmlLayerSteps
from corral.kernels.head_screen import ScreenedRows, head_screen_enabled, screen_rows, settle_screened
from corral.kernels.layer_kernels import layer_parts
from corral.kernels.logit_refinement import BestAmong, refine_near_top
from corral.kernels.projection import Projection
from corral.kernels.quantized_projection import (
    Quantization,
    QuantizedProjection,
    head_quantization,
    layer_quantization,
    quantizable,
)
from corral.kernels.row_kernel import LAYER_MAX_ROWS, layer_graphs_available
from corral.kernels.screens import HeadScreens, head_screens
from corral.kernels.split_projection import SplitProjection, head_projection
from corral.server.models.checkpoint import iter_tensors
from corral.server.models.decoder_config import DecoderShape, decoder_shape, rope_frequencies

log = logging.getLogger(__name__)

class Attend(Protocol):
    """Attention over the cache for one layer: writes this step's keys/values, returns [T, heads, head_dim]."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


def _projection(
    weight: torch.Tensor, bias: torch.Tensor | None, quantization: Quantization
) -> Projection | QuantizedProjection:
    if quantizable(weight, quantization):
        # Nothing selects a layer's rows; steps of few tokens may go to ggml's kernel
        # (corral/kernels/row_kernel.py).
        return QuantizedProjection(weight, bias, quantization, keep_rows=False, row_kernel=True)
    return Projection(weight, bias)


class _Layer(torch.nn.Module):
    def __init__(
        self, weights: dict[str, torch.Tensor], shape: DecoderShape, quantization: Quantization
    ) -> None:
        """fp16 projections keep an fp16 copy on ggml for steps of few tokens (corral/kernels/row_kernel.py)."""
        super().__init__()

        def param(t: torch.Tensor) -> torch.nn.Parameter:
            return torch.nn.Parameter(t, requires_grad=False)

        def norm(name: str) -> torch.nn.Parameter:
            return param(_norm_gain(weights[name], shape))

        self.input_norm = norm("input_layernorm.weight")
        # q, k and v (and gate and up) share their input: one matmul each instead of three (two).
        qkv = torch.cat([weights.pop(f"self_attn.{p}_proj.weight") for p in "qkv"])
        biases = [weights.pop(f"self_attn.{p}_proj.bias", None) for p in "qkv"]
        if any(b is not None for b in biases) and not all(b is not None for b in biases):
            raise ValueError("the checkpoint has biases on some but not all of q/k/v")
        qkv_bias = torch.cat([b for b in biases if b is not None]) if biases[0] is not None else None
        self.qkv = _projection(qkv, qkv_bias, quantization)
        o_weight, o_bias = weights["self_attn.o_proj.weight"], weights.get("self_attn.o_proj.bias")
        self.o = _projection(o_weight, o_bias, quantization)
        has_qk_norm = "self_attn.q_norm.weight" in weights and "self_attn.k_norm.weight" in weights
        if shape.qk_norm and not has_qk_norm:
            raise ValueError("the checkpoint has no q_norm/k_norm weights, which this architecture needs")
        # q and k are normed per head and rotated together, one call each for all their heads: the gain is
        # q_norm's on the query heads and k_norm's on the key heads ([heads + kv_heads, head_dim]).
        self.qk_norm_gain = (
            param(
                torch.cat([
                    _norm_gain(weights["self_attn.q_norm.weight"], shape).expand(shape.num_heads, -1),
                    _norm_gain(weights["self_attn.k_norm.weight"], shape).expand(shape.num_kv_heads, -1),
                ])
            )
            if has_qk_norm
            else None
        )
        # Llama: post_attention_layernorm is the MLP's input norm. Gemma: it norms the attention output and
        # pre/post_feedforward_layernorm norm the MLP's input and output.
        self.attn_out_norm = norm("post_attention_layernorm.weight") if shape.sandwich_norms else None
        mlp_norm = "pre_feedforward_layernorm.weight" if shape.sandwich_norms else "post_attention_layernorm.weight"
        self.mlp_norm = norm(mlp_norm)
        self.mlp_out_norm = norm("post_feedforward_layernorm.weight") if shape.sandwich_norms else None
        gate_up = torch.cat([weights.pop("mlp.gate_proj.weight"), weights.pop("mlp.up_proj.weight")])
        gate_b, up_b = weights.get("mlp.gate_proj.bias"), weights.get("mlp.up_proj.bias")
        gate_up_bias = torch.cat([gate_b, up_b]) if gate_b is not None and up_b is not None else None
        self.gate_up = _projection(gate_up, gate_up_bias, quantization)
        down_weight, down_bias = weights["mlp.down_proj.weight"], weights.get("mlp.down_proj.bias")
        self.down = _projection(down_weight, down_bias, quantization)


def _norm_gain(weight: torch.Tensor, shape: DecoderShape) -> torch.Tensor:
    """The RMS norm's multiplier: Gemma stores it as an offset from 1 (its norms scale by 1 + weight)."""
    return weight + shape.norm_offset if shape.norm_offset else weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the Hugging Face layout (the two halves of head_dim form the complex pairs)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class LlamaFamilyModel(torch.nn.Module):
    """The decoder and its output head; `forward` takes a packed step and returns its rows' last logits."""

    def __init__(
        self,
        shape: DecoderShape,
        weights: dict[str, torch.Tensor],
        ropes: Mapping[str, tuple[torch.Tensor, float]],
        config: Any,
        quantization: Quantization = "none",
    ) -> None:
        """ropes: per layer type, its RoPE inverse frequencies and cos/sin scale (rope_frequencies).
        quantization: the projections' and head's weight-only quantization
        (corral/kernels/quantized_projection.py)."""
        if quantization == "gguf":
            raise ValueError("--quantization gguf serves a GGUF from its blocks (corral/server/models/gguf_decoder.py)")
        super().__init__()
        self.shape = shape
        self.quantization = quantization
        self.config = config  # the transformers config, for metadata (vocab, eos ids, context length)
        self.embed = torch.nn.Parameter(weights.pop("model.embed_tokens.weight"), requires_grad=False)
        self.layers = torch.nn.ModuleList()
        for i in range(shape.num_layers):
            prefix = f"model.layers.{i}."
            own = {k[len(prefix) :]: weights.pop(k) for k in [k for k in weights if k.startswith(prefix)]}
            self.layers.append(_Layer(own, shape, layer_quantization(quantization)))
        self.norm = torch.nn.Parameter(_norm_gain(weights.pop("model.norm.weight"), shape), requires_grad=False)
        head = weights.pop("lm_head.weight", None)
        # The plain head stays beside the packed one (for a tied head it is the embedding anyway): a
        # grammar-restricted row computes its few allowed logits from it (restricted_logits). A quantized
        # head computes them from its own quantized values instead.
        self.head = head_projection(self.embed if head is None else head, head_quantization(quantization))
        # The scale as a tensor of the model's dtype: the embedding is multiplied in that dtype, as trained.
        self.embed_scale: torch.Tensor
        self.register_buffer("embed_scale", torch.tensor(shape.embed_scale, dtype=self.embed.dtype), persistent=False)
        self.rope_types = tuple(dict.fromkeys(shape.layer_types))
        self._layer_rope = [self.rope_types.index(t) for t in shape.layer_types]
        self.inv_freqs = [ropes[t][0].to(self.embed.device) for t in self.rope_types]
        self.rope_scales = [ropes[t][1] for t in self.rope_types]
        self.layer_steps = self._layer_graphs()
        screened = quantization == "fp16" and self.embed.device.type == "cpu" and head_screen_enabled()
        self.screens = self._head_screens(self.embed if head is None else head) if screened else None

    @torch.inference_mode()
    def _head_screens(self, weight: torch.Tensor) -> HeadScreens:
        """The screens for rows that need only their best token (corral/kernels/screens.py)."""

        def hidden_of(ids: torch.Tensor, attend: Attend) -> torch.Tensor:
            every = torch.arange(len(ids))
            return self.hidden(ids, every, every, attend)

        return head_screens(weight, hidden_of, self.shape.attn_scale)

    def _layer_graphs(self) -> GgmlLayerSteps | None:
        """ggml graphs for the layers of steps of few tokens, where every projection has a ggml row kernel (fp16
        with the `ggml` extra) and the switch allows them (corral/kernels/row_kernel.py)."""
        if not layer_graphs_available():
            return None
        s = self.shape
        layers = [layer for layer in self.layers if isinstance(layer, _Layer)]
        parts = [
            layer_parts(layer, self._layer_rope[i], s.layer_windows[i])
            for i, layer in enumerate(layers)
        ]
        if any(part is None for part in parts):
            return None
        scale = s.attn_scale if s.attn_scale is not None else s.head_dim**-0.5
        step_shape = StepShape(s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim, s.rms_eps, s.activation, scale)
        ropes = list(zip(self.inv_freqs, self.rope_scales, strict=True))
        return GgmlLayerSteps(step_shape, [p for p in parts if p is not None], ropes, self.norm, LAYER_MAX_ROWS)

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV cache's dtype: the model's own (the one-graph decoder reads float32 caches)."""
        return self.embed.dtype

    def step_read_bytes(self) -> int:
        """Bytes of weights one decode step reads: every projection and the head (the embedding only a row)."""
        # A greedy row's head is a screen (and a few exact outputs), the step's largest read.
        screened = None if self.screens is None else self.screens.one_row_bytes
        projections: list[Any] = [self.head] if screened is None else []
        total = screened or 0
        for layer in self.layers:
            assert isinstance(layer, _Layer)
            projections += [layer.qkv, layer.o, layer.gate_up, layer.down]
        for projection in projections:
            for part in getattr(projection, "parts", [projection]):
                quantized = isinstance(part, QuantizedProjection)
                total += part.weight_bytes if quantized else part.out_features * part.in_features * self.embed.itemsize
        return total

    def rope(self, positions: torch.Tensor, dtype: torch.dtype, table: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim] for the tokens' absolute positions (computed in float32, as trained)."""
        freqs = positions[:, None].float() * self.inv_freqs[table][None, :]
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        scale = self.rope_scales[table]
        return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, last: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """input_ids, positions: [T] (every row's new tokens, packed); last: [B] index of each row's last
        token in the pack. Returns float32 logits [B, vocab]."""
        return self.head(self.hidden(input_ids, positions, last, attend)).float()

    def hidden(
        self, input_ids: torch.Tensor, positions: torch.Tensor, last: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """The decoder without its head: each row's last token's final-normed hidden state [B, hidden]."""
        s = self.shape
        eps = s.rms_eps
        x = F.embedding(input_ids, self.embed)
        if s.embed_scale != 1.0:
            x = x * self.embed_scale
        if self.layer_steps is not None and self.layer_steps.takes(len(input_ids)) and x.device.type == "cpu":
            return self.layer_steps.hidden(x, positions, last, attend)
        tables = [self.rope(positions, x.dtype, t) for t in range(len(self.rope_types))]
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, _Layer)
            cos, sin = tables[self._layer_rope[i]]
            h = F.rms_norm(x, (s.hidden_size,), layer.input_norm, eps)
            qk, v = torch.split(layer.qkv(h), [q_size + kv_size, kv_size], dim=-1)
            qk = qk.view(-1, s.num_heads + s.num_kv_heads, s.head_dim)
            if layer.qk_norm_gain is not None:
                qk = F.rms_norm(qk, (s.head_dim,), None, eps) * layer.qk_norm_gain
            qk = _rotate(qk, cos, sin)
            q, k = qk[:, : s.num_heads], qk[:, s.num_heads :]
            attn = attend(i, q, k, v.view(-1, s.num_kv_heads, s.head_dim))
            out = layer.o(attn.reshape(-1, q_size))
            if layer.attn_out_norm is not None:
                out = F.rms_norm(out, (s.hidden_size,), layer.attn_out_norm, eps)
            x = x + out
            h = F.rms_norm(x, (s.hidden_size,), layer.mlp_norm, eps)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            gated = F.silu(gate) if s.activation == "silu" else F.gelu(gate, approximate="tanh")
            out = layer.down(gated * up)
            if layer.mlp_out_norm is not None:
                out = F.rms_norm(out, (s.hidden_size,), layer.mlp_out_norm, eps)
            x = x + out
        # Only each row's last token needs logits: the vocabulary projection is the step's largest matmul.
        return F.rms_norm(x.index_select(0, last), (s.hidden_size,), self.norm, eps)

    def restricted_logits(
        self, hidden: torch.Tensor, allowed: Mapping[int, torch.Tensor], best_only: Iterable[int] = ()
    ) -> tuple[torch.Tensor, ScreenedRows | None]:
        """Float32 logits [B, vocab] where row r in `allowed` gets only its allowed token ids computed (the
        rest -inf, as its grammar mask would set them) and every other row the full projection; rows in
        `best_only` (that need only their best token) the screen's, settled exactly by `refine`, which takes the
        screened rows returned beside the logits."""
        screened = [row for row in best_only if row not in allowed]
        screen = None if self.screens is None else self.screens.for_rows(len(screened))
        if screen is None:
            screened = []
        if not allowed and not screened:
            return self.head(hidden).float(), None
        batch = hidden.shape[0]
        logits = torch.full((batch, self.head.out_features), float("-inf"), device=hidden.device)
        found = screen_rows(screen, hidden, screened, logits) if screen is not None and screened else None
        full = [row for row in range(batch) if row not in allowed and row not in screened]
        if full:
            index = torch.tensor(full, device=hidden.device)
            logits.index_copy_(0, index, self.head(hidden.index_select(0, index)).float())
        keys = sorted(allowed)
        columns = torch.cat([allowed[row] for row in keys] or [torch.zeros(0, dtype=torch.long)]).to(hidden.device)
        counts = torch.tensor([len(allowed[row]) for row in keys], dtype=torch.long)
        rows = torch.repeat_interleave(torch.tensor(keys, dtype=torch.long), counts).to(hidden.device)
        if len(columns):
            logits[rows, columns] = self.head.select(hidden, rows, columns).float()
        return logits, found

    def refine(
        self, logits: torch.Tensor, hidden: torch.Tensor, rows: list[int], depths: list[int],
        screened_rows: ScreenedRows | None = None,
    ) -> BestAmong:
        """Recompute in place, exactly, each given row's logits near its best (down to its depth) where the
        head's kernel rounds them (corral/kernels/logit_refinement.py); `hidden` gave `logits`. Screened rows
        (`restricted_logits` returned them) get their candidates' exact logits instead
        (corral/kernels/head_screen.py)."""
        if screened_rows is not None:
            full = settle_screened(self.head, logits, hidden, screened_rows, rows)
            screened = set(screened_rows.rows) - set(full)
            depths = [d for row, d in zip(rows, depths, strict=True) if row not in screened]
            rows = [row for row in rows if row not in screened]
        if isinstance(self.head, (SplitProjection, QuantizedProjection)):
            return refine_near_top(self.head, logits, hidden, rows, depths)
        return {}


_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_llama_family(
    model_dir: Path,
    config: Any,
    dtype: torch.dtype,
    device: torch.device,
    quantization: Quantization = "none",
) -> LlamaFamilyModel:
    """Build the decoder from `model_dir`'s safetensors; raises ValueError/OSError on a bad checkpoint."""
    weights = {
        name: tensor.to(device=device, dtype=dtype)
        for name, tensor in _plain_names(iter_tensors(model_dir))
        if not name.endswith(_IGNORED_SUFFIXES)
    }
    if "model.embed_tokens.weight" not in weights:
        raise ValueError("the checkpoint has no model.embed_tokens.weight")
    if "lm_head.weight" not in weights and not getattr(config, "tie_word_embeddings", False):
        raise ValueError("the checkpoint has no lm_head.weight and its config does not tie it to the embedding")
    return llama_family_from_weights(config, weights, quantization)


def llama_family_from_weights(
    config: Any, weights: dict[str, torch.Tensor], quantization: Quantization = "none"
) -> LlamaFamilyModel:
    """The decoder over `weights` (Hugging Face names, consumed), with the config's RoPE tables."""
    shape = decoder_shape(config)
    ropes = {t: rope_frequencies(config, shape.head_dim, t) for t in dict.fromkeys(shape.layer_types)}
    try:
        model = LlamaFamilyModel(shape, weights, ropes, config, quantization)
    except KeyError as exc:
        raise ValueError(f"the checkpoint lacks weight {exc}") from exc
    unused = [k for k in weights if not k.startswith("model.layers.")]
    if unused:
        log.warning("ignoring %d unexpected checkpoint tensors, e.g. %s", len(unused), unused[0])
    return model.eval()


def _plain_names(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
    """Checkpoints saved from a bare decoder lack the "model." prefix on the decoder's weights."""
    for name, tensor in tensors:
        if name.startswith(("model.", "lm_head.")):
            yield name, tensor
        else:
            yield f"model.{name}", tensor
