"""Model loading and the embedded default model (built offline into tmp dirs; never touches ~/.cache)."""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from corral.server.models import LoadedModel, ModelLoadError, ensure_default_model, load_model
from corral.server.models.checkpoint_meta import GENERIC_CHAT_TEMPLATE
from corral.server.models.default_model import MODEL_DIRNAME

EOT_ID = 128009
END_OF_TEXT_ID = 128001
REVISE_ID = 128256


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corral-cache")
    ensure_default_model(root)
    return root


@pytest.fixture(scope="module")
def default(cache_root: Path) -> Iterator[LoadedModel]:
    # load_model("corral-tiny") must find the cache through CORRAL_CACHE_DIR, not ~/.cache. These tests check the
    # checkpoint itself, so they read it through transformers' reference forward.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CORRAL_CACHE_DIR", str(cache_root))
        yield load_model("corral-tiny", device="cpu", model_impl="transformers")


def _next_logits(loaded: LoadedModel, text: str) -> torch.Tensor:
    messages = [{"role": "user", "content": text}]
    ids: Any = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    with torch.no_grad():
        out = loaded.model(torch.tensor([list(ids)], device=loaded.device))
    logits: torch.Tensor = out.logits[0, -1].float()
    return logits


def test_build_is_deterministic_and_replaces_incomplete_cache(cache_root: Path, tmp_path: Path) -> None:
    # A leftover directory without the completion marker (e.g. a hand-made or damaged cache) is rebuilt.
    junk = tmp_path / MODEL_DIRNAME
    junk.mkdir()
    (junk / "config.json").write_text("{}")
    second = ensure_default_model(tmp_path)
    first = cache_root / MODEL_DIRNAME
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert _sha256(first / name) == _sha256(second / name), name
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temp build dir left behind"


def test_second_call_reuses_cache(cache_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    weights = cache_root / MODEL_DIRNAME / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    start = time.perf_counter()
    assert ensure_default_model(cache_root) == cache_root / MODEL_DIRNAME
    monkeypatch.setenv("CORRAL_CACHE_DIR", str(cache_root))
    assert ensure_default_model() == cache_root / MODEL_DIRNAME
    assert time.perf_counter() - start < 1.0
    assert weights.stat().st_mtime_ns == mtime


def test_tokenizer_has_revision_token(default: LoadedModel) -> None:
    tok = default.tokenizer
    assert len(tok) == 128_257
    assert default.vocab_size == 128_257
    assert tok.encode("<|revise|>", add_special_tokens=False) == [REVISE_ID]
    assert REVISE_ID in tok.all_special_ids
    assert default.revision_token_id == REVISE_ID
    assert tok.convert_tokens_to_ids("<|begin_of_text|>") == 128000
    assert tok.eos_token == "<|eot_id|>"
    assert tok.pad_token == "<|end_of_text|>"


def test_loaded_default_metadata(default: LoadedModel) -> None:
    assert default.name == "corral-tiny"
    assert default.path.name == MODEL_DIRNAME
    assert EOT_ID in default.stop_token_ids
    assert END_OF_TEXT_ID in default.stop_token_ids
    assert default.context_length == 4096
    assert default.device == torch.device("cpu")
    assert default.dtype == torch.float32
    assert not default.model.training


def test_chat_template_llama3_layout(default: LoadedModel) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = default.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|begin_of_text|>"
        "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_structure_bias_and_context_dependence(default: LoadedModel) -> None:
    tok = default.tokenizer
    a = _next_logits(default, "Give me a JSON object with a name.")
    b = _next_logits(default, "What is the weather like today?")
    for logits in (a, b):
        # After the generation prompt, free text starts with a Capitalised word (end-of-turn waits).
        top = tok.convert_ids_to_tokens(int(logits.argmax()))
        assert top[0].isupper() and top[1:].isalpha(), top
        assert logits[EOT_ID] < logits[tok.convert_tokens_to_ids('"')]
        # Tier order: closing quote beats every ordinary word; <|revise|> is never sampled spontaneously.
        quote, word = tok.convert_tokens_to_ids('"'), tok.convert_tokens_to_ids("hello")
        ordinary = logits[1000:100_000]
        assert logits[word] < logits[quote]
        assert logits[REVISE_ID] < ordinary.min()
    assert float((a - b).abs().max()) > 1e-4


def test_missing_chat_template_gets_generic(cache_root: Path, tmp_path: Path) -> None:
    src = cache_root / MODEL_DIRNAME
    dst = tmp_path / "no-template"
    dst.mkdir()
    for f in src.iterdir():
        if f.name == "chat_template.jinja":
            continue
        if f.name == "model.safetensors":
            os.symlink(f, dst / f.name)  # avoid copying the weights
        else:
            shutil.copy(f, dst / f.name)
    loaded = load_model(dst, device="cpu")
    assert loaded.name == "no-template"
    assert loaded.tokenizer.chat_template == GENERIC_CHAT_TEMPLATE
    text = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "user: Hi\nassistant: "


def test_error_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope", device="cpu")


def test_error_not_a_directory(tmp_path: Path) -> None:
    f = tmp_path / "weights.bin"
    f.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="not a directory"):
        load_model(f, device="cpu")


def test_error_no_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        load_model(tmp_path, device="cpu")


def test_error_not_causal(tmp_path: Path) -> None:
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16)
    bert_dir = tmp_path / "bert"
    BertModel(config).save_pretrained(bert_dir)
    with pytest.raises(ModelLoadError, match="causal") as info:
        load_model(bert_dir, device="cpu")
    assert "BertModel" in str(info.value)
    assert "\n" not in str(info.value)


def test_error_unknown_dtype(cache_root: Path) -> None:
    with pytest.raises(ModelLoadError, match="dtype"):
        load_model(cache_root / MODEL_DIRNAME, device="cpu", dtype="float8")


def test_error_unknown_revision_token(cache_root: Path) -> None:
    with pytest.raises(ModelLoadError, match="Revision token"):
        load_model(cache_root / MODEL_DIRNAME, device="cpu", revision_token="<|no-such-token|>")


def test_bias_tiers_order(default: LoadedModel) -> None:
    tok = default.tokenizer
    logits = _next_logits(default, "Tiers.")
    order = ['"', "@", ":", "}", ",", "-", "7"]
    values = [float(logits[tok.convert_tokens_to_ids(t)]) for t in order]
    assert values == sorted(values, reverse=True), dict(zip(order, values, strict=True))
    # Whitespace must lose to JSON content, or "any whitespace" grammars would loop on it.
    assert float(logits[tok.convert_tokens_to_ids("Ġ")]) < 0
    assert float(logits[tok.convert_tokens_to_ids("Ċ")]) < 0


def test_greedy_json_schema_generation_finishes(default: LoadedModel) -> None:
    """The point of the bias: a random model under a JSON-schema grammar still ends quickly."""
    xgr = pytest.importorskip("xgrammar")
    import json

    tok = default.tokenizer
    info = xgr.TokenizerInfo.from_huggingface(
        tok, vocab_size=default.vocab_size, stop_token_ids=list(default.stop_token_ids)
    )
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "email": {"type": "string", "format": "email"},
            "tags": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["name", "age", "email", "tags"],
    }
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema)))
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    messages = [{"role": "user", "content": "JSON please"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    ids: list[int] = list(prompt["input_ids"])
    out: list[int] = []
    for _ in range(80):
        with torch.no_grad():
            logits = default.model(torch.tensor([ids + out])).logits[:, -1].float()
        matcher.fill_next_token_bitmask(bitmask)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        token = int(logits.argmax())
        assert matcher.accept_token(token)
        if matcher.is_terminated():
            break
        out.append(token)
    else:
        pytest.fail(f"generation did not finish: {tok.decode(out)!r}")
    value = json.loads(tok.decode(out))
    assert set(value) == {"name", "age", "email", "tags"}


def test_default_model_runs_on_corrals_decoder(cache_root: Path, default: LoadedModel) -> None:
    """auto picks corral's own decoder for the default Llama; its logits are transformers' logits."""
    from corral.server.engine.model_runner import ForwardRow, ModelRunner
    from corral.server.models.llama_family import LlamaFamilyModel

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CORRAL_CACHE_DIR", str(cache_root))
        own = load_model("corral-tiny", device="cpu")
    assert own.impl == "corral" and isinstance(own.model, LlamaFamilyModel)
    assert (own.stop_token_ids, own.context_length, own.vocab_size) == (
        default.stop_token_ids,
        default.context_length,
        default.vocab_size,
    )
    ids = own.tokenizer.encode("Give me a JSON object with a name.")
    logits = ModelRunner(own, max_batch=1, max_len=64).forward([ForwardRow(0, 0, ids)])[0]
    with torch.no_grad():
        reference = default.model(torch.tensor([ids])).logits[0, -1].float()
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)


def test_model_impl_corral_refuses_other_architectures(tmp_path: Path, cache_root: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model_dir = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(vocab_size=128_257, n_embd=32, n_layer=1, n_head=2)).save_pretrained(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(cache_root / MODEL_DIRNAME / name, model_dir / name)
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel is not in corral's Llama family"):
        load_model(model_dir, device="cpu", model_impl="corral")
    assert load_model(model_dir, device="cpu").impl == "transformers"
    with pytest.raises(ModelLoadError, match="Unknown model implementation"):
        load_model(model_dir, device="cpu", model_impl="vllm")


@pytest.mark.parametrize("quantization", ["int8", "int4", "w8a8", "fp16", "fp16-w8a8"])
def test_quantized_decoder_tracks_the_float_one(cache_root: Path, default: LoadedModel, quantization: str) -> None:
    """Weight-only quantization changes the logits by rounding only: the same most likely tokens, close values."""
    from corral.kernels.quantized_projection import QuantizedProjection
    from corral.server.engine.model_runner import ForwardRow, ModelRunner

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CORRAL_CACHE_DIR", str(cache_root))
        plain = load_model("corral-tiny", device="cpu")
        quantized = load_model("corral-tiny", device="cpu", quantization=quantization)
    assert quantized.quantization == quantization and plain.quantization == "none"
    layer = quantized.model.layers[0]
    assert all(isinstance(p, QuantizedProjection) for p in (layer.qkv, layer.o, layer.gate_up, layer.down))
    if quantization == "fp16-w8a8":  # fp16 layers, an integer head
        assert layer.qkv.bits == 16 and all(part.bits == 8 for part in quantized.model.head.parts)
    # corral-tiny is mostly its head, which stays int8 under int4 (head_quantization): ~4x fewer bytes either way;
    # fp16 halves them.
    fewer = 1.9 if quantization == "fp16" else 3.5
    assert quantized.model.step_read_bytes() < plain.model.step_read_bytes() / fewer
    ids = plain.tokenizer.encode("Give me a JSON object with a name.")
    rows = [ForwardRow(0, 0, ids)]
    reference = ModelRunner(plain, max_batch=1, max_len=64).forward(rows)[0]
    logits = ModelRunner(quantized, max_batch=1, max_len=64).forward(rows)[0]
    top = set(reference.topk(5).indices.tolist())
    assert int(logits.argmax()) in top
    spread = float(reference.std())
    bound = {"fp16": 0.005, "int8": 0.05}.get(quantization, 0.25)
    assert float((logits - reference).abs().mean()) < spread * bound


def test_quantization_needs_corrals_decoder_on_cpu(cache_root: Path) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CORRAL_CACHE_DIR", str(cache_root))
        with pytest.raises(ModelLoadError, match="needs corral's own decoder"):
            load_model("corral-tiny", device="cpu", model_impl="transformers", quantization="int4")
        with pytest.raises(ModelLoadError, match="Unknown quantization 'int3'"):
            load_model("corral-tiny", device="cpu", quantization="int3")


def test_without_fbgemm_auto_falls_back_to_int8_and_fbgemm_modes_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """`auto` serves a GGUF from its own blocks where ggml is installed, else in fp16; ARM builds of torch carry
    no fbgemm: there it falls back to int8, and fp16/w8a8 say why not."""
    from corral.server.models import loading

    cpu = torch.device("cpu")
    monkeypatch.setattr(loading, "layer_graphs_available", lambda: True)
    assert loading._check_quantization("auto", "corral", cpu, from_gguf=True) == "gguf"
    monkeypatch.setattr(loading, "layer_graphs_available", lambda: False)
    assert loading._check_quantization("auto", "corral", cpu, from_gguf=True) == "fp16"
    monkeypatch.setattr(loading, "fbgemm_available", lambda: False)
    assert loading._check_quantization("auto", "corral", cpu, from_gguf=True) == "int8"
    assert loading._check_quantization("auto", "corral", cpu, from_gguf=False) == "none"
    for mode in ("fp16", "w8a8", "fp16-w8a8"):
        with pytest.raises(ModelLoadError, match=f"--quantization {mode} runs fbgemm's kernels"):
            loading._check_quantization(mode, "corral", cpu, from_gguf=True)
