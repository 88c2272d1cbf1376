"""corral's own decoder for the Llama family (Llama 2/3.x, Qwen2/2.5, Qwen3, Mistral), read from safetensors.

All tokens of a step, from every row, are packed into one [T, hidden] batch: the projections, norms and MLP
run once for the whole step whatever the rows' lengths, and only attention needs to know which row a token
belongs to. That part is delegated to an `Attend` (the KV cache: server/engine/kv_cache.py), so this module
holds only the arithmetic and runs unchanged on CPU and CUDA.

Configuration comes from transformers (AutoConfig), weights straight from the checkpoint's safetensors files.
Differences across the family are all data: Qwen2 has q/k/v biases (any bias in the checkpoint is used),
Qwen3 normalises q and k per head, Llama 3.1+ scales RoPE frequencies ("llama3"), heads may be grouped (GQA)
and the output head may be tied to the embedding. Sliding-window attention is not implemented: such a model
is served with its context capped at the window, where full attention is exactly what it computes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from server.models.checkpoint import iter_tensors
from server.models.projection import Projection
from server.models.split_projection import head_projection

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"})
_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})
# RoPE variants whose frequencies do not depend on the sequence length (those are refused: "dynamic", "longrope").
_STATIC_ROPE = frozenset({"default", "linear", "llama3", "yarn"})


class Attend(Protocol):
    """Attention over the cache for one layer: writes this step's keys/values, returns [T, heads, head_dim]."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class DecoderShape:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    qk_norm: bool
    sliding_window: int | None  # the smallest window any layer uses, None: every layer attends fully


def _rope_parameters(config: Any) -> dict[str, Any]:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    return params


def _sliding_window(config: Any) -> int | None:
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or window <= 0:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return window


def unsupported_reason(config: Any) -> str | None:
    """Why corral's decoder cannot run this config (then transformers does), or None when it can."""
    architectures = [str(a) for a in (getattr(config, "architectures", None) or [])]
    if architectures and architectures[0] not in SUPPORTED_ARCHITECTURES:
        return f"architecture {architectures[0]} is not in corral's Llama family"
    if not architectures and getattr(config, "model_type", None) not in _MODEL_TYPES:
        return f"model type {getattr(config, 'model_type', None)!r} is not in corral's Llama family"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} (only silu)"
    params = _rope_parameters(config)
    if any(isinstance(v, dict) for v in params.values()):
        return "per-layer RoPE parameters"
    if params["rope_type"] not in _STATIC_ROPE:
        return f"RoPE type {params['rope_type']!r}"
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        return "partial rotary embeddings"
    return None


def decoder_shape(config: Any) -> DecoderShape:
    heads = int(config.num_attention_heads)
    return DecoderShape(
        vocab_size=int(config.vocab_size),
        hidden_size=int(config.hidden_size),
        num_layers=int(config.num_hidden_layers),
        num_heads=heads,
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
        rms_eps=float(config.rms_norm_eps),
        qk_norm=str(getattr(config, "model_type", "")) == "qwen3",
        sliding_window=_sliding_window(config),
    )


def rope_frequencies(config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim / 2] (float32) and the cos/sin scale ("attention factor")."""
    params = _rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type == "default":
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (float(params["rope_theta"]) ** exponents), 1.0
    # Scaled variants: transformers owns the config's meaning; reuse its (static) frequency functions.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.float(), float(scale)


class _Layer(torch.nn.Module):
    def __init__(self, weights: dict[str, torch.Tensor], shape: DecoderShape) -> None:
        super().__init__()

        def param(t: torch.Tensor) -> torch.nn.Parameter:
            return torch.nn.Parameter(t, requires_grad=False)

        def optional(t: torch.Tensor | None) -> torch.nn.Parameter | None:
            return None if t is None else param(t)

        self.input_norm = param(weights["input_layernorm.weight"])
        # q, k and v (and gate and up) share their input: one matmul each instead of three (two).
        qkv = torch.cat([weights.pop(f"self_attn.{p}_proj.weight") for p in "qkv"])
        biases = [weights.pop(f"self_attn.{p}_proj.bias", None) for p in "qkv"]
        if any(b is not None for b in biases) and not all(b is not None for b in biases):
            raise ValueError("the checkpoint has biases on some but not all of q/k/v")
        qkv_bias = torch.cat([b for b in biases if b is not None]) if biases[0] is not None else None
        self.qkv = Projection(qkv, qkv_bias)
        self.o = Projection(weights["self_attn.o_proj.weight"], weights.get("self_attn.o_proj.bias"))
        self.q_norm = optional(weights.get("self_attn.q_norm.weight"))
        self.k_norm = optional(weights.get("self_attn.k_norm.weight"))
        if shape.qk_norm and (self.q_norm is None or self.k_norm is None):
            raise ValueError("a Qwen3 checkpoint without q_norm/k_norm weights")
        self.post_norm = param(weights["post_attention_layernorm.weight"])
        gate_up = torch.cat([weights.pop("mlp.gate_proj.weight"), weights.pop("mlp.up_proj.weight")])
        gate_b, up_b = weights.get("mlp.gate_proj.bias"), weights.get("mlp.up_proj.bias")
        gate_up_bias = torch.cat([gate_b, up_b]) if gate_b is not None and up_b is not None else None
        self.gate_up = Projection(gate_up, gate_up_bias)
        self.down = Projection(weights["mlp.down_proj.weight"], weights.get("mlp.down_proj.bias"))


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
        inv_freq: torch.Tensor,
        rope_scale: float,
        config: Any,
    ) -> None:
        super().__init__()
        self.shape = shape
        self.config = config  # the transformers config, for metadata (vocab, eos ids, context length)
        self.embed = torch.nn.Parameter(weights.pop("model.embed_tokens.weight"), requires_grad=False)
        self.layers = torch.nn.ModuleList()
        for i in range(shape.num_layers):
            prefix = f"model.layers.{i}."
            own = {k[len(prefix) :]: weights.pop(k) for k in [k for k in weights if k.startswith(prefix)]}
            self.layers.append(_Layer(own, shape))
        self.norm = torch.nn.Parameter(weights.pop("model.norm.weight"), requires_grad=False)
        head = weights.pop("lm_head.weight", None)
        # The plain head stays beside the packed one (for a tied head it is the embedding anyway): a
        # grammar-restricted row computes its few allowed logits from it (restricted_logits).
        self.head = head_projection(self.embed if head is None else head)
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq.to(self.embed.device), persistent=False)
        self.rope_scale = rope_scale

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim] for the tokens' absolute positions (computed in float32, as trained)."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return (angles.cos() * self.rope_scale).to(dtype), (angles.sin() * self.rope_scale).to(dtype)

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
        cos, sin = self.rope(positions, x.dtype)
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, _Layer)
            h = F.rms_norm(x, (s.hidden_size,), layer.input_norm, eps)
            q, k, v = torch.split(layer.qkv(h), [q_size, kv_size, kv_size], dim=-1)
            q = q.view(-1, s.num_heads, s.head_dim)
            k = k.view(-1, s.num_kv_heads, s.head_dim)
            if layer.q_norm is not None and layer.k_norm is not None:
                q = F.rms_norm(q, (s.head_dim,), layer.q_norm, eps)
                k = F.rms_norm(k, (s.head_dim,), layer.k_norm, eps)
            attn = attend(i, _rotate(q, cos, sin), _rotate(k, cos, sin), v.view(-1, s.num_kv_heads, s.head_dim))
            x = x + layer.o(attn.reshape(-1, q_size))
            h = F.rms_norm(x, (s.hidden_size,), layer.post_norm, eps)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        # Only each row's last token needs logits: the vocabulary projection is the step's largest matmul.
        return F.rms_norm(x.index_select(0, last), (s.hidden_size,), self.norm, eps)

    def restricted_logits(self, hidden: torch.Tensor, allowed: Mapping[int, torch.Tensor]) -> torch.Tensor:
        """Float32 logits [B, vocab] where row r in `allowed` gets only its allowed token ids computed (the
        rest -inf, as its grammar mask would set them) and every other row the full projection."""
        if not allowed:
            return self.head(hidden).float()
        batch = hidden.shape[0]
        logits = torch.full((batch, self.head.out_features), float("-inf"), device=hidden.device)
        full = [row for row in range(batch) if row not in allowed]
        if full:
            index = torch.tensor(full, device=hidden.device)
            logits.index_copy_(0, index, self.head(hidden.index_select(0, index)).float())
        keys = sorted(allowed)
        columns = torch.cat([allowed[row] for row in keys]).to(hidden.device)
        counts = torch.tensor([len(allowed[row]) for row in keys])
        rows = torch.repeat_interleave(torch.tensor(keys), counts).to(hidden.device)
        if len(columns):
            logits[rows, columns] = self.head.select(hidden, rows, columns).float()
        return logits


_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_llama_family(model_dir: Path, config: Any, dtype: torch.dtype, device: torch.device) -> LlamaFamilyModel:
    """Build the decoder from `model_dir`'s safetensors; raises ValueError/OSError on a bad checkpoint."""
    shape = decoder_shape(config)
    weights = {
        name: tensor.to(device=device, dtype=dtype)
        for name, tensor in _plain_names(iter_tensors(model_dir))
        if not name.endswith(_IGNORED_SUFFIXES)
    }
    if "model.embed_tokens.weight" not in weights:
        raise ValueError("the checkpoint has no model.embed_tokens.weight")
    if "lm_head.weight" not in weights and not getattr(config, "tie_word_embeddings", False):
        raise ValueError("the checkpoint has no lm_head.weight and its config does not tie it to the embedding")
    inv_freq, scale = rope_frequencies(config, shape.head_dim)
    try:
        model = LlamaFamilyModel(shape, weights, inv_freq, scale, config)
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
