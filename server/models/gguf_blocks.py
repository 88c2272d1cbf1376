"""A GGUF's own quantized blocks (Q4_K, Q5_0, Q6_K, Q8_0...) for ggml's products: decode at llama.cpp's bytes.

corral serves a GGUF from a checkpoint dequantized once into the serving dtype (gguf_import.py), and reads
its fp16 copy per step (536 MB a token for Gemma 3 270M). llama.cpp reads the file's blocks themselves (253
MB), multiplying them by activations rounded to 8 bits inside ggml's kernels. `--quantization gguf` does the
same for steps of few tokens: the projections and the head take the GGUF's blocks, untouched, through ggml
(server/models/ggml_layers.py); larger steps keep fbgemm's fp16 product of the same (dequantized) values.

The blocks are extracted once into the cache, beside the converted checkpoint, as raw bytes per projection
(`ggml-blocks.safetensors`, uint8 [out_features, bytes per row], the ggml type in the metadata). Each is
checked to dequantize to the checkpoint's weight, so a file whose layout differs from the Hugging Face one
(llama.cpp permutes the q/k rows of `llama`-architecture files for its RoPE) is refused with the name of the
first weight that differs, instead of serving wrong products.
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
    dequantizes to the weight of the same name in `checkpoint` (a directory of safetensors)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    from server.models.checkpoint import iter_tensors

    reader = GGUFReader(gguf_path)
    wanted = {name: t for t in reader.tensors if (name := checkpoint_name(t.name)) is not None}
    if not wanted:
        raise BlocksError(f"{gguf_path.name} has no projection weights that corral knows by name")
    blocks: dict[str, torch.Tensor] = {}
    types: dict[str, list[int | str]] = {}
    for name, reference in iter_tensors(checkpoint):
        tensor = wanted.get(name)
        if tensor is None:
            continue
        values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        expected = reference.float().numpy()
        values = values.reshape(expected.shape) if values.size == expected.size else values
        # The checkpoint holds the same values in the serving dtype: equal within that dtype's rounding.
        tolerance = float(torch.finfo(reference.dtype).eps) * float(np.abs(expected).max() or 1.0)
        if values.shape != expected.shape or float(np.abs(values - expected).max()) > tolerance:
            raise BlocksError(
                f"{tensor.name} in {gguf_path.name} does not dequantize to the checkpoint's {name} "
                "(a layout llama.cpp changed for its own RoPE?): its blocks cannot serve this model"
            )
        raw = np.ascontiguousarray(tensor.data).view(np.uint8).reshape(expected.shape[0], -1)
        blocks[name] = torch.from_numpy(raw.copy())
        types[name] = [int(tensor.tensor_type), tensor.tensor_type.name, int(expected.shape[0]), int(expected.shape[1])]
    missing = sorted(set(wanted) - set(blocks))
    if missing:
        raise BlocksError(f"the checkpoint lacks {missing[0]}, which {gguf_path.name} has")
    save_file(blocks, str(out / BLOCKS_FILE), metadata={_TYPES_KEY: json.dumps(types)})


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
