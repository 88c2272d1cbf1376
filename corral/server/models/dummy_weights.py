"""Random weights at a real model's shapes (`--load-format dummy`, vLLM's name for it): speed at a shape does not
depend on the weights' values, and real weights of an 8B model cannot reach a machine that has no registry.

`--model` then names a shape: one of `SHAPES` (Llama 3.1 8B, Qwen2.5 7B, Qwen2.5 1.5B: the Hugging Face
configs' shape fields) or a Hugging Face `config.json`. The tokenizer is corral-tiny's (Llama 3's, 128,257
tokens), the one built-in tokenizer that travels without a model package. A config with a larger vocabulary
keeps its logits' width (ids past the tokenizer's are never allowed by a grammar); a smaller one grows to the
tokenizer's. Weights are drawn on the serving device from a fixed seed (`DUMMY_SEED`): the same shape and dtype
give the same weights, so the two decoders can be compared on them. Their scales keep activations near 1 in
bfloat16 at any depth: projections N(0, 1/fan_in), the two that write to the residual stream scaled by
1/sqrt(2 * layers) more, norm gains 1, so logits spread by a few units and grammar masks still decide picks.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from corral.server.models.decoder_config import decoder_shape

DUMMY_SEED = 0
LLAMA3_IDS = {"bos_token_id": 128000, "eos_token_id": [128009, 128001]}  # corral-tiny's tokenizer's
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "tie_word_embeddings": False,
    },
    "qwen2.5-7b": {
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584,
        "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
        "vocab_size": 152064, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "tie_word_embeddings": False,
    },
    "qwen2.5-1.5b": {
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 1536,
        "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
        "vocab_size": 151936, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "tie_word_embeddings": True,
    },
}
# Architectures whose attention projections carry biases whatever the config says (Qwen2's q, k and v).
QKV_BIAS_TYPES = frozenset({"qwen2"})


def dummy_config(model: str | Path) -> Any:
    """The transformers config a dummy load serves: a `SHAPES` name, a config.json, or a directory holding one.
    ValueError naming the shapes when it is none of them."""
    if isinstance(model, str) and model in SHAPES:
        fields = {**SHAPES[model], **LLAMA3_IDS}
    else:
        path = Path(model).expanduser()
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise ValueError(f"--load-format dummy needs a shape ({', '.join(SHAPES)}) or a config.json; "
                             f"{str(model)!r} is neither")
        try:
            fields = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path} is not a readable JSON config: {exc}") from exc
        if not isinstance(fields, dict) or "model_type" not in fields:
            raise ValueError(f"{path} has no model_type")
    from transformers import AutoConfig

    fields = dict(fields)
    model_type = fields.pop("model_type")
    return AutoConfig.for_model(model_type, **fields)


def dummy_weights(
    config: Any, dtype: torch.dtype, device: torch.device, seed: int = DUMMY_SEED
) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors (Hugging Face names) for `config`, drawn on `device` from `seed`."""
    text = config.get_text_config()
    shape = decoder_shape(text)
    generator = torch.Generator(device=device).manual_seed(seed)
    out_scale = 1.0 / math.sqrt(2 * shape.num_layers)

    def normal(rows: int, cols: int, std: float) -> torch.Tensor:
        # Drawn in float32 (normal_ in bfloat16 is not on every device), kept in `dtype`.
        return torch.empty(rows, cols, device=device).normal_(0.0, std, generator=generator).to(dtype)

    def gain(size: int) -> torch.Tensor:  # a norm's stored weight for a gain of 1
        return torch.full((size,), 1.0 - shape.norm_offset, dtype=dtype, device=device)

    h, heads, kv, d = shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim
    inter = int(text.intermediate_size)
    biases = text.model_type in QKV_BIAS_TYPES or bool(getattr(text, "attention_bias", False))
    tied = bool(getattr(text, "tie_word_embeddings", False))
    # A tied embedding is the head too: scaled as a head (logits of a few units); the norm at each layer's input
    # makes up for its small rows.
    embed_std = h**-0.5 if tied else 1.0 / shape.embed_scale
    weights = {"model.embed_tokens.weight": normal(shape.vocab_size, h, embed_std)}
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": gain(h),
            p + "self_attn.q_proj.weight": normal(heads * d, h, h**-0.5),
            p + "self_attn.k_proj.weight": normal(kv * d, h, h**-0.5),
            p + "self_attn.v_proj.weight": normal(kv * d, h, h**-0.5),
            p + "self_attn.o_proj.weight": normal(h, heads * d, out_scale * (heads * d) ** -0.5),
            p + "post_attention_layernorm.weight": gain(h),
            p + "mlp.gate_proj.weight": normal(inter, h, h**-0.5),
            p + "mlp.up_proj.weight": normal(inter, h, h**-0.5),
            p + "mlp.down_proj.weight": normal(h, inter, out_scale * inter**-0.5),
        }
        if biases:
            for name, size in (("q", heads * d), ("k", kv * d), ("v", kv * d)):
                weights[p + f"self_attn.{name}_proj.bias"] = torch.zeros(size, dtype=dtype, device=device)
        if shape.qk_norm:
            weights[p + "self_attn.q_norm.weight"] = gain(d)
            weights[p + "self_attn.k_norm.weight"] = gain(d)
        if shape.sandwich_norms:
            weights[p + "pre_feedforward_layernorm.weight"] = gain(h)
            weights[p + "post_feedforward_layernorm.weight"] = gain(h)
    weights["model.norm.weight"] = gain(h)
    if not tied:
        weights["lm_head.weight"] = normal(shape.vocab_size, h, h**-0.5)
    return weights
