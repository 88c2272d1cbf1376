"""An exact head_dim re-layout of a Llama checkpoint, so a peer server that refuses small heads can serve it.

vLLM-cpu's attention refuses head_dim 16, which the tiny model, corral-tiny uses. The same function with
head_dim D > d: every q/k/v head is zero-padded from d to D dimensions, with the original rotary halves placed
at 0..d/2-1 and D/2..D/2+d/2-1 (transformers' and vLLM's rotate-half pairs dimension i with i + D/2).
rope_theta becomes theta**(D/d), so pair i keeps its frequency theta**(-2i/d); the padded pairs rotate zeros.
q is scaled by sqrt(D/d), which cancels the attention scale's change from 1/sqrt(d) to 1/sqrt(D). o_proj gets
zero columns where v got zero rows. Everything else (embeddings, MLP, norms, lm_head, tokenizer) is copied.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path
from typing import Any

import torch

from corral.benchmarks.serve.peer import PEER_HEAD_DIM

log = logging.getLogger(__name__)

_MARKER = "corral-peer-model.json"


def padded_positions(head_dim: int, new_head_dim: int) -> torch.Tensor:
    """Where each original head dimension goes in the padded head: the two rotary halves stay halves."""
    if head_dim % 2 or new_head_dim % 2:
        raise ValueError(f"head dims must be even for rotary pairs, got {head_dim} -> {new_head_dim}")
    if new_head_dim < head_dim:
        raise ValueError(f"cannot shrink heads: {head_dim} -> {new_head_dim}")
    half, new_half = head_dim // 2, new_head_dim // 2
    return torch.cat([torch.arange(half), torch.arange(half) + new_half])


def _pad_rows(weight: torch.Tensor, heads: int, head_dim: int, new_head_dim: int) -> torch.Tensor:
    """(heads*head_dim, in) → (heads*new_head_dim, in) with zero rows in the new dimensions."""
    src = weight.reshape(heads, head_dim, -1)
    out = torch.zeros(heads, new_head_dim, src.shape[-1], dtype=weight.dtype)
    out[:, padded_positions(head_dim, new_head_dim), :] = src
    return out.reshape(heads * new_head_dim, -1)


def _pad_columns(weight: torch.Tensor, heads: int, head_dim: int, new_head_dim: int) -> torch.Tensor:
    """o_proj: (out, heads*head_dim) → (out, heads*new_head_dim) with zero columns matching v's zero rows."""
    return _pad_rows(weight.t(), heads, head_dim, new_head_dim).t().contiguous()


def relayout_state_dict(state: dict[str, torch.Tensor], *, heads: int, kv_heads: int, head_dim: int,
                        new_head_dim: int) -> dict[str, torch.Tensor]:
    """The padded weights (see the module docstring); keys are unchanged. Attention biases are refused
    (Llama has none; Qwen2's would need the same padding, not needed here)."""
    q_scale = math.sqrt(new_head_dim / head_dim)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias", "o_proj.bias")):
            raise ValueError(f"attention biases are not supported by the re-layout: {name}")
        if name.endswith("q_proj.weight"):
            out[name] = _pad_rows(tensor, heads, head_dim, new_head_dim) * q_scale
        elif name.endswith(("k_proj.weight", "v_proj.weight")):
            out[name] = _pad_rows(tensor, kv_heads, head_dim, new_head_dim)
        elif name.endswith("o_proj.weight"):
            out[name] = _pad_columns(tensor, heads, head_dim, new_head_dim)
        else:
            out[name] = tensor.clone()
    return out


def relayout_config(config: dict[str, Any], new_head_dim: int) -> dict[str, Any]:
    """config.json for the padded model: head_dim and rope_theta (θ → θ^(D/d)); only plain RoPE is exact."""
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    rope = dict(config.get("rope_parameters") or {})
    rope_type = rope.get("rope_type", (config.get("rope_scaling") or {}).get("rope_type", "default"))
    if rope_type != "default":
        raise ValueError(f"only plain RoPE keeps its frequencies under the re-layout, got rope_type {rope_type!r}")
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    new_theta = theta ** (new_head_dim / head_dim)
    out = dict(config)
    out["head_dim"] = new_head_dim
    if "rope_parameters" in out or "rope_theta" not in out:
        out["rope_parameters"] = {**rope, "rope_type": "default", "rope_theta": new_theta}
    if "rope_theta" in out:
        out["rope_theta"] = new_theta
    return out


def write_peer_model(src: Path, out: Path, new_head_dim: int = PEER_HEAD_DIM) -> Path:
    """Write the re-laid-out checkpoint of `src` (a Llama checkpoint dir) into `out`; returns `out`."""
    from safetensors.torch import load_file, save_file

    config = json.loads((src / "config.json").read_text(encoding="utf-8"))
    if config.get("model_type") != "llama":
        raise ValueError(f"{src}: model_type {config.get('model_type')!r}; the re-layout is for Llama checkpoints")
    heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    weights = sorted(src.glob("*.safetensors"))
    if not weights:
        raise ValueError(f"{src}: no *.safetensors weights")
    out.mkdir(parents=True, exist_ok=True)
    for path in weights:
        state = relayout_state_dict(load_file(str(path)), heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                    new_head_dim=new_head_dim)
        save_file(state, str(out / path.name), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(relayout_config(config, new_head_dim), indent=2) + "\n",
                                     encoding="utf-8")
    copied = [p.name for p in src.iterdir()
              if p.is_file() and p.suffix != ".safetensors" and p.name != "config.json"
              and not p.name.startswith("corral-")]  # corral's own cache markers stay behind
    for name in copied:
        shutil.copyfile(src / name, out / name)
    (out / _MARKER).write_text(json.dumps({
        "source": str(src), "head_dim": [head_dim, new_head_dim], "weights": [p.name for p in weights],
        "copied": sorted(copied)}, indent=2) + "\n", encoding="utf-8")
    log.info("wrote %s: head_dim %d -> %d", out, head_dim, new_head_dim)
    return out
