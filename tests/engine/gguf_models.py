"""Small models of the Llama family written as GGUF files the way llama.cpp's converter writes them (tensor
names, Gemma's norm gains stored with their +1, a `llama` file's q/k rows interleaved), with mixed block types,
and the transformers model holding exactly the values the blocks decode to: the reference for
server/models/gguf_decoder.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

VOCAB = 256
# GGUF name -> the block type its weight is written in (what the gguf package can write: block 32 types).
BLOCK_TYPES = {"attn_q": "Q5_0", "attn_k": "Q8_0", "attn_v": "Q4_0", "attn_output": "Q4_0", "ffn_gate": "Q8_0",
               "ffn_up": "Q4_0", "ffn_down": "Q8_0", "token_embd": "Q8_0", "output": "Q4_0"}
_PROJECTIONS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}


def small_config(arch: str, head_dim: int | None = None) -> Any:
    """A two-layer config of `arch` (llama, qwen2, gemma3) with grouped heads; Gemma with a 16-token window.
    head_dim (llama, qwen2): two heads of that size sharing one key-value head, else four of 16."""
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config

    heads = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    if head_dim is not None:
        heads = {"hidden_size": 2 * head_dim, "num_attention_heads": 2, "num_key_value_heads": 1}
    common = {"vocab_size": VOCAB, "intermediate_size": 96, "num_hidden_layers": 2, "max_position_embeddings": 256,
              **heads}
    if arch == "llama":
        return LlamaConfig(**common, tie_word_embeddings=False)
    if arch == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=False)
    return Gemma3TextConfig(
        **common, head_dim=32, sliding_window=16, layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=20, tie_word_embeddings=True,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}},
    )


def _interleave(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for a `llama` file: within a head, the two halves' rows interleaved."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def write_small_gguf(
    path: Path, arch: str, seed: int = 0, head_dim: int | None = None, key_bias: float | None = None
) -> Any:
    """Write a small `arch` model to `path` and return the transformers model of the values it holds. head_dim:
    as small_config takes it. key_bias (qwen2): every query and key bias set to it, so scores grow past float16's
    range as Qwen2.5's layer 0's do."""
    import gguf
    from gguf.quants import dequantize, quantize
    from transformers import AutoModelForCausalLM

    config = small_config(arch, head_dim)
    torch.manual_seed(seed)
    model: Any = AutoModelForCausalLM.from_config(config).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    params = dict(model.named_parameters())
    gemma = arch == "gemma3"
    with torch.no_grad():
        for name, param in params.items():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_((0.1 if gemma else 1.0) + 0.1 * noise)  # Gemma's gains are offsets from 1
            else:
                param.copy_((0.3 if name.endswith(".bias") else 0.08) * noise)
            if key_bias is not None and name.endswith(("q_proj.bias", "k_proj.bias")):
                param.fill_(key_bias)
    writer = gguf.GGUFWriter(str(path), arch)

    def add(gguf_name: str, hf_name: str, kind: str | None = None, heads: int | None = None) -> None:
        param = params[hf_name]
        values = param.detach().numpy().astype(np.float32)
        if kind is None:  # a float tensor: norms (Gemma's with the +1 its converter adds) and biases
            writer.add_tensor(gguf_name, values + (1.0 if gemma and "norm" in gguf_name else 0.0))
            return
        qtype = gguf.GGMLQuantizationType[kind]
        raw = quantize(values, qtype)
        decoded = dequantize(raw, qtype)
        with torch.no_grad():
            param.copy_(torch.from_numpy(decoded))  # the reference holds what the blocks encode
        if heads is not None:
            raw = quantize(_interleave(decoded, heads), qtype)  # exact: a row's blocks are whole rows
        writer.add_tensor(gguf_name, raw, raw_dtype=qtype)

    add("token_embd.weight", "model.embed_tokens.weight", BLOCK_TYPES["token_embd"])
    if not config.tie_word_embeddings:
        add("output.weight", "lm_head.weight", BLOCK_TYPES["output"])
    add("output_norm.weight", "model.norm.weight")
    for i in range(config.num_hidden_layers):
        p, hf = f"blk.{i}.", f"model.layers.{i}."
        for ours, theirs in _PROJECTIONS.items():
            heads = None
            if arch == "llama" and ours in ("attn_q", "attn_k"):
                heads = config.num_attention_heads if ours == "attn_q" else config.num_key_value_heads
            add(p + ours + ".weight", hf + theirs + ".weight", BLOCK_TYPES[ours], heads)
        if arch == "qwen2":
            for x in "qkv":
                add(p + f"attn_{x}.bias", hf + f"self_attn.{x}_proj.bias")
        add(p + "attn_norm.weight", hf + "input_layernorm.weight")
        if gemma:
            add(p + "post_attention_norm.weight", hf + "post_attention_layernorm.weight")
            add(p + "ffn_norm.weight", hf + "pre_feedforward_layernorm.weight")
            add(p + "post_ffw_norm.weight", hf + "post_feedforward_layernorm.weight")
            add(p + "attn_q_norm.weight", hf + "self_attn.q_norm.weight")
            add(p + "attn_k_norm.weight", hf + "self_attn.k_norm.weight")
        else:
            add(p + "ffn_norm.weight", hf + "post_attention_layernorm.weight")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model
