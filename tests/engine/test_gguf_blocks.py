"""`--quantization gguf`: a GGUF's own quantized blocks serve steps of few tokens through ggml
(server/models/gguf_blocks.py). A small Gemma 3 written here as a GGUF with mixed block types (Q8_0, Q5_0,
Q4_0: what the gguf package can write) and its dequantized checkpoint: the blocks are extracted and checked
against the checkpoint, a decode step multiplies them, and a step of many tokens keeps fp16's product."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from server.engine.model_runner import ForwardRow, ModelRunner
from server.models.gguf_blocks import BlocksError, QuantBlocks, checkpoint_name, extract_blocks, load_blocks
from server.models.llama_family import LlamaFamilyModel, load_llama_family
from server.models.loading import LoadedModel, ModelLoadError, load_model
from server.models.row_kernel import LAYER_MAX_ROWS, RowKernel, layer_graphs_available

pytestmark = pytest.mark.skipif(
    not layer_graphs_available(),
    reason="ggml is off: the ggml extra is not installed (pip install -e '.[ggml]') or CORRAL_ROW_KERNEL says so",
)

VOCAB = 512
# GGUF name -> block type (the file's mix: llama.cpp's Q4_K_M mixes 4 of them too).
_TYPES = {"attn_q": "Q5_0", "attn_k": "Q8_0", "attn_v": "Q4_0", "attn_output": "Q4_0", "ffn_gate": "Q8_0",
          "ffn_up": "Q5_0", "ffn_down": "Q8_0"}
_HF = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
       "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
       "ffn_down": "mlp.down_proj"}


def _config() -> Any:
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=20,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}},
        tie_word_embeddings=True,
    )


def _write_model(directory: Path) -> tuple[Path, Path, Any]:
    """A GGUF of quantized blocks and the checkpoint of their dequantized values (what corral converts to)."""
    import gguf
    from gguf.quants import dequantize, quantize
    from transformers import AutoModelForCausalLM

    config = _config()
    torch.manual_seed(0)
    model: Any = AutoModelForCausalLM.from_config(config)
    generator = torch.Generator().manual_seed(1)
    path = directory / "small.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.08 * noise)
        blocks = [("token_embd.weight", "model.embed_tokens.weight", "Q8_0")]
        for layer in range(config.num_hidden_layers):
            for ours, kind in _TYPES.items():
                blocks.append((f"blk.{layer}.{ours}.weight", f"model.layers.{layer}.{_HF[ours]}.weight", kind))
        params = dict(model.named_parameters())
        for gguf_name, hf_name, kind in blocks:
            qtype = gguf.GGMLQuantizationType[kind]
            raw = quantize(params[hf_name].numpy(), qtype)
            writer.add_tensor(gguf_name, raw, raw_dtype=qtype)
            params[hf_name].copy_(torch.from_numpy(dequantize(raw, qtype)))  # the checkpoint holds what they encode
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    checkpoint = directory / "checkpoint"
    model.save_pretrained(checkpoint)
    return path, checkpoint, model.config


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Any, Path]:
    directory = tmp_path_factory.mktemp("gguf-blocks")
    path, checkpoint, config = _write_model(directory)
    blocks_dir = directory / "blocks"
    blocks_dir.mkdir()
    extract_blocks(path, checkpoint, blocks_dir)
    return path, checkpoint, config, blocks_dir


def _runner(model: LlamaFamilyModel) -> ModelRunner:
    loaded = LoadedModel(model=model, tokenizer=None, path=Path("."), name="small", vocab_size=VOCAB,
                         stop_token_ids=(), revision_token_id=None, context_length=256,
                         device=torch.device("cpu"), dtype=torch.float32, impl="corral")
    return ModelRunner(loaded, max_batch=4, max_len=128)


def test_names_map_to_the_checkpoint() -> None:
    assert checkpoint_name("blk.3.attn_output.weight") == "model.layers.3.self_attn.o_proj.weight"
    assert checkpoint_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert checkpoint_name("token_embd.weight") == "model.embed_tokens.weight"
    assert checkpoint_name("blk.0.attn_norm.weight") is None  # norms stay the checkpoint's


def test_extracted_blocks_keep_each_weights_type_and_bytes(written: tuple[Path, Path, Any, Path]) -> None:
    from gguf import GGUFReader

    path, _, _, blocks_dir = written
    blocks = load_blocks(blocks_dir)
    assert len(blocks) == 1 + 2 * len(_TYPES)
    for tensor in GGUFReader(path).tensors:
        name = checkpoint_name(tensor.name)
        assert name is not None
        assert blocks[name].type_name == tensor.tensor_type.name
        assert blocks[name].data.tobytes() == np.asarray(tensor.data).tobytes()  # the file's bytes, untouched


def test_a_row_through_blocks_is_the_product_of_their_values(written: tuple[Path, Path, Any, Path]) -> None:
    from gguf.quants import dequantize

    blocks = load_blocks(written[3])
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.v_proj.weight"):
        one: QuantBlocks = blocks[name]
        import gguf

        values = torch.from_numpy(dequantize(one.data, gguf.GGMLQuantizationType[one.type_name]))
        x = torch.randn(3, one.in_features)
        out = RowKernel(one, max_rows=4)(x)
        # ggml rounds the input to 8 bits per block of 32 (Q8_0) for the dot product: ~1 % of an output's size;
        # a wrong type or layout gives outputs unrelated to the product.
        torch.testing.assert_close(out, x @ values.T, rtol=0.0, atol=0.02 * float((x @ values.T).abs().max()))


def test_blocks_that_do_not_match_the_checkpoint_are_refused(written: tuple[Path, Path, Any, Path],
                                                              tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    path, checkpoint, _, _ = written
    changed = tmp_path / "changed"
    changed.mkdir()
    for item in checkpoint.iterdir():
        (changed / item.name).write_bytes(item.read_bytes())
    weights = load_file(str(changed / "model.safetensors"))
    weights["model.layers.1.mlp.up_proj.weight"][0, 0] += 0.01
    save_file(weights, str(changed / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(BlocksError, match=r"blk\.1\.ffn_up\.weight .* does not dequantize to the checkpoint's"):
        extract_blocks(path, changed, out)


def test_steps_of_few_tokens_multiply_the_blocks(written: tuple[Path, Path, Any, Path]) -> None:
    _, checkpoint, config, blocks_dir = written
    blocks = load_blocks(blocks_dir)
    fp16 = load_llama_family(checkpoint, config, torch.float32, torch.device("cpu"), "fp16")
    gguf = load_llama_family(checkpoint, config, torch.float32, torch.device("cpu"), "gguf", blocks)
    assert gguf.step_read_bytes() == sum(b.data.nbytes for b in blocks.values())  # the tied head once
    assert gguf.step_read_bytes() < fp16.step_read_bytes() / 2  # 4.5-8.5 bits a weight against 16
    runners = [_runner(fp16), _runner(gguf)]
    generator = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, VOCAB, (20,), generator=generator).tolist()
    worst, agree, picks = 0.0, 0, 0
    for slot in range(2):
        long_step = [r.forward([ForwardRow(slot=slot, start=0, tokens=prompt)]) for r in runners]
        torch.testing.assert_close(long_step[0], long_step[1], rtol=0, atol=1e-5)  # > 16 tokens: fp16 on both
    lengths = [20, 20]
    for step in range(30):
        tokens = torch.randint(0, VOCAB, (3,), generator=generator).tolist()
        if step % 5 == 4:  # a row fed 3 tokens: the one-graph decoder's query blocks
            rows = [ForwardRow(slot=0, start=lengths[0], tokens=tokens)]
        elif step % 5 == 2:  # rows out of slot order: their queries gathered into the slots' blocks
            rows = [ForwardRow(slot=s, start=lengths[s], tokens=[tokens[s]]) for s in (1, 0)]
        else:  # one or two single-token rows: the one-graph decoder
            rows = [ForwardRow(slot=s, start=lengths[s], tokens=[tokens[s]]) for s in range(1 + step % 2)]
        assert sum(len(r.tokens) for r in rows) <= LAYER_MAX_ROWS
        reference, ours = (r.forward(rows) for r in runners)
        for row in rows:
            lengths[row.slot] += len(row.tokens)
        scale = float(reference.abs().max())
        worst = max(worst, float((ours - reference).abs().max()) / scale)
        agree += int((ours.argmax(-1) == reference.argmax(-1)).sum())
        picks += len(rows)
    # Activations rounded to 8 bits per block of 32 against fp16, through this random model's layers and KV
    # caches that drift apart step by step: measured 1-9 % of the largest logit, the greedy pick the same in
    # ~85 % of rows. A block of the wrong weight, type or layout (gate and up swapped, q/k/v out of order)
    # moves logits by their own size.
    assert 0.0 < worst < 0.15 and agree >= 0.7 * picks
    steps = gguf.layer_steps
    assert steps is not None and steps.decoder_steps > steps.multi_query_steps > 0


def test_gguf_needs_a_model_that_came_from_a_gguf() -> None:
    with pytest.raises(ModelLoadError, match="does not come from a GGUF"):
        load_model("corral-tiny", device="cpu", quantization="gguf")
