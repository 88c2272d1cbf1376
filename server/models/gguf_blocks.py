"""A GGUF's own quantized blocks (Q4_K, Q5_0, Q6_K, Q8_0...) for ggml's products: decode at llama.cpp's bytes.

corral serves a GGUF from a checkpoint dequantized once into the serving dtype (gguf_import.py), and reads
its fp16 copy per step (536 MB a token for Gemma 3 270M). llama.cpp reads the file's blocks themselves (253
MB), multiplying them by activations rounded to 8 bits inside ggml's kernels. `--quantization gguf` does the
same for steps of few tokens: the projections and the head take the GGUF's blocks, untouched, through ggml
(server/models/ggml_layers.py); larger steps keep fbgemm's fp16 product of the same (dequantized) values.

The blocks are extracted once into the cache, beside the converted checkpoint, as raw bytes per projection
(`ggml-blocks.safetensors`, uint8 [out_features, bytes per row], the ggml type in the metadata). Each is
checked to dequantize to the checkpoint's weight (llama.cpp interleaves the q/k rows of `llama`-architecture
files for its RoPE: those rows are put back in order, whole blocks at a time), so a file that does not hold
the checkpoint's weights is refused with the name of the first weight that differs instead of serving wrong
products.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

BLOCKS_FILE = "ggml-blocks.safetensors"
_TYPES_KEY = "ggml_types"  # metadata: {name: [ggml type id, type name, out_features, in_features]}
_LAYER_PROJECTIONS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.weight$")


class BlocksError(ValueError):
    """The GGUF's blocks cannot serve this checkpoint (their values or layout differ)."""


@dataclass(frozen=True)
class QuantBlocks:
    """One projection's weight as ggml stores it: rows of quantized blocks."""

    data: np.ndarray  # uint8 [out_features, bytes per row]
    ggml_type: int
    type_name: str
    out_features: int
    in_features: int


def checkpoint_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF projection weight (None for norms and everything else)."""
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    match = _LAYER_NAME.match(gguf_name)
    if match is None or match.group(2) not in _LAYER_PROJECTIONS:
        return None
    return f"model.layers.{match.group(1)}.{_LAYER_PROJECTIONS[match.group(2)]}.weight"


def extract_blocks(gguf_path: Path, checkpoint: Path, out: Path) -> None:
    """Write `out`/BLOCKS_FILE: every projection weight of the GGUF as its raw blocks, after checking that each
    dequantizes to the weight of the same name in `checkpoint` (a directory of safetensors with its
    config.json). q and k rows that llama.cpp interleaved for its RoPE are put back in the checkpoint's order."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    from server.models.checkpoint import iter_tensors

    reader = GGUFReader(gguf_path)
    wanted = {name: t for t in reader.tensors if (name := checkpoint_name(t.name)) is not None}
    if not wanted:
        raise BlocksError(f"{gguf_path.name} has no projection weights that corral knows by name")
    heads = _head_counts(checkpoint)
    blocks: dict[str, torch.Tensor] = {}
    types: dict[str, list[int | str]] = {}
    for name, reference in iter_tensors(checkpoint):
        tensor = wanted.get(name)
        if tensor is None:
            continue
        values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        expected = reference.float().numpy()
        raw = np.ascontiguousarray(tensor.data).view(np.uint8).reshape(values.shape[0], -1)
        # The checkpoint holds the same values in the serving dtype: equal within that dtype's rounding.
        tolerance = float(torch.finfo(reference.dtype).eps) * float(np.abs(expected).max() or 1.0)
        if not _same(values, expected, tolerance):
            count = heads.get(name.rsplit(".", 2)[-2])  # q_proj / k_proj: llama.cpp may have permuted its rows
            order = _rope_rows(values.shape[0], count) if count else None
            if order is None or not _same(values[order], expected, tolerance):
                raise BlocksError(
                    f"{tensor.name} in {gguf_path.name} does not dequantize to the checkpoint's {name}: its "
                    "blocks cannot serve this model"
                )
            raw = raw[order]  # each row is whole blocks: reordering rows reorders the weight's rows exactly
        blocks[name] = torch.from_numpy(raw.copy())
        types[name] = [int(tensor.tensor_type), tensor.tensor_type.name, int(expected.shape[0]), int(expected.shape[1])]
    missing = sorted(set(wanted) - set(blocks))
    if missing:
        raise BlocksError(f"the checkpoint lacks {missing[0]}, which {gguf_path.name} has")
    save_file(blocks, str(out / BLOCKS_FILE), metadata={_TYPES_KEY: json.dumps(types)})


def _same(values: np.ndarray, expected: np.ndarray, tolerance: float) -> bool:
    return values.shape == expected.shape and float(np.abs(values - expected).max()) <= tolerance


def _head_counts(checkpoint: Path) -> dict[str, int]:
    """Heads of q and of k, by projection name, from the checkpoint's config (empty where it has none)."""
    try:
        config = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    config = config.get("text_config", config)
    heads = config.get("num_attention_heads")
    if not isinstance(heads, int):
        return {}
    kv_heads = config.get("num_key_value_heads") or heads
    return {"q_proj": heads, "k_proj": int(kv_heads)}


def _rope_rows(rows: int, heads: int) -> np.ndarray | None:
    """The order that undoes llama.cpp's q/k permutation (within each head, the rows of the two halves of
    head_dim interleaved, so that its RoPE pairs adjacent dimensions): index i of the result is the GGUF
    row that holds the checkpoint's row i."""
    if rows % (2 * heads):
        return None
    half = rows // heads // 2
    # The GGUF's row for (head h, pair p, side s) is h*2*half + p*2 + s; the checkpoint's is h*2*half + s*half + p.
    gguf_rows = np.arange(rows).reshape(heads, half, 2)
    return np.ascontiguousarray(gguf_rows.transpose(0, 2, 1)).reshape(rows)


def load_blocks(directory: Path) -> dict[str, QuantBlocks]:
    """The blocks `extract_blocks` wrote into `directory`, by Hugging Face weight name."""
    from safetensors import safe_open

    path = directory / BLOCKS_FILE
    with safe_open(str(path), framework="np") as handle:
        metadata = handle.metadata() or {}
        types = json.loads(metadata.get(_TYPES_KEY, "{}"))
        found = {}
        for name, (kind, type_name, out_features, in_features) in types.items():
            found[name] = QuantBlocks(handle.get_tensor(name), int(kind), str(type_name), out_features, in_features)
    return found
