"""What corral's decoders read from a model's config: whether the family is one they serve (and why not), the
decoder's shape (heads, norms, activation, sliding windows per layer) and each layer type's RoPE frequencies.
Shared by the safetensors decoder (llama_family.py) and the GGUF one (gguf_decoder.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = frozenset(
    {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM", "Gemma3ForCausalLM"}
)
_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral", "gemma3_text"})
_GEMMA_TYPES = frozenset({"gemma3_text"})
# transformers' activation names -> the MLP gate corral computes.
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# RoPE variants whose frequencies do not depend on the sequence length (those are refused: "dynamic", "longrope").
_STATIC_ROPE = frozenset({"default", "linear", "llama3", "yarn"})


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
    layer_windows: tuple[int | None, ...]  # per layer: its sliding window, None: full attention
    layer_types: tuple[str, ...]  # per layer: its RoPE table ("full_attention" / "sliding_attention")
    activation: str = "silu"  # the MLP gate: "silu" or "gelu_tanh"
    embed_scale: float = 1.0  # Gemma: sqrt(hidden_size)
    attn_scale: float | None = None  # None: 1 / sqrt(head_dim)
    sandwich_norms: bool = False  # Gemma: attention and MLP outputs are normed before the residual add
    norm_offset: float = 0.0  # Gemma's norms scale by (1 + weight)


def _activation_name(config: Any) -> str:
    return str(getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None) or "silu")


def _layer_types(config: Any) -> list[str]:
    types = getattr(config, "layer_types", None)
    if isinstance(types, list | tuple) and len(types) == int(config.num_hidden_layers):
        return [str(t) for t in types]
    return ["full_attention"] * int(config.num_hidden_layers)


def _rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = dict(params)
    if params and all(isinstance(v, dict) for v in params.values()):
        # Per layer type (Gemma 3: a local base for sliding layers, a global one for full attention).
        params = dict(params.get(layer_type or "full_attention") or next(iter(params.values())))
    params.setdefault("rope_type", params.get("type", "default"))
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    return params


def _layer_windows(config: Any) -> tuple[int | None, ...]:
    types = _layer_types(config)
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or window <= 0 or getattr(config, "use_sliding_window", True) is False:
        return (None,) * len(types)
    if getattr(config, "layer_types", None) is None:
        return (window,) * len(types)  # Mistral-style: one window for every layer
    return tuple(window if t == "sliding_attention" else None for t in types)


def unsupported_reason(config: Any) -> str | None:
    """Why corral's decoder cannot run this config (then transformers does), or None when it can."""
    architectures = [str(a) for a in (getattr(config, "architectures", None) or [])]
    if architectures and architectures[0] not in SUPPORTED_ARCHITECTURES:
        return f"architecture {architectures[0]} is not in corral's Llama family"
    if not architectures and getattr(config, "model_type", None) not in _MODEL_TYPES:
        return f"model type {getattr(config, 'model_type', None)!r} is not in corral's Llama family"
    if _activation_name(config) not in _ACTIVATIONS:
        return f"activation {_activation_name(config)!r} (only {', '.join(_ACTIVATIONS)})"
    for layer_type in dict.fromkeys(_layer_types(config)):
        params = _rope_parameters(config, layer_type)
        if any(isinstance(v, dict) for v in params.values()):
            return "nested RoPE parameters"
        if params["rope_type"] not in _STATIC_ROPE:
            return f"RoPE type {params['rope_type']!r}"
        if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
            return "partial rotary embeddings"
    for attr in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, attr, None) is not None:
            return f"logit soft-capping ({attr})"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention"
    if len({w for w in _layer_windows(config) if w is not None}) > 1:
        return "more than one sliding-window size"
    return None


def decoder_shape(config: Any) -> DecoderShape:
    heads = int(config.num_attention_heads)
    gemma = str(getattr(config, "model_type", "")) in _GEMMA_TYPES
    scalar = getattr(config, "query_pre_attn_scalar", None)
    return DecoderShape(
        vocab_size=int(config.vocab_size),
        hidden_size=int(config.hidden_size),
        num_layers=int(config.num_hidden_layers),
        num_heads=heads,
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
        rms_eps=float(config.rms_norm_eps),
        qk_norm=str(getattr(config, "model_type", "")) == "qwen3" or gemma,
        layer_windows=_layer_windows(config),
        layer_types=tuple(_layer_types(config)),
        activation=_ACTIVATIONS.get(_activation_name(config), "silu"),
        embed_scale=float(config.hidden_size) ** 0.5 if gemma else 1.0,
        attn_scale=float(scalar) ** -0.5 if gemma and scalar else None,
        sandwich_norms=gemma,
        norm_offset=1.0 if gemma else 0.0,
    )


def rope_frequencies(config: Any, head_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim / 2] (float32) and the cos/sin scale ("attention factor") of the RoPE
    table that layers of `layer_type` use (models with one table ignore it)."""
    params = _rope_parameters(config, layer_type)
    rope_type = params["rope_type"]
    if rope_type == "default":
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (float(params["rope_theta"]) ** exponents), 1.0
    # Scaled variants: transformers owns the config's meaning; reuse its (static) frequency functions.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    init = ROPE_INIT_FUNCTIONS[rope_type]
    if (
        layer_type is not None
        and isinstance(getattr(config, "rope_parameters", None), dict)
        and all(isinstance(v, dict) for v in config.rope_parameters.values())
    ):
        inv_freq, scale = init(config, torch.device("cpu"), layer_type=layer_type)
    else:
        inv_freq, scale = init(config, torch.device("cpu"))
    return inv_freq.float(), float(scale)
