"""Turn a GGUF file (llama.cpp's format) into a Hugging Face checkpoint directory that corral serves.

transformers reads GGUF (config from the metadata, the tokenizer rebuilt from its vocabulary, tensors
dequantized with the `gguf` package); corral writes the result once as safetensors in the serving dtype, so
later starts load it like any checkpoint. The architecture is checked first, from the file's metadata, so an
unsupported or broken file fails in a second rather than after the slow part.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import torch

from corral.server.models.gguf_header import GGUFHeaderError, read_fields

logger = logging.getLogger(__name__)

# GGUF `general.architecture` -> the transformers class corral serves it as (own decoder or transformers).
SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}

# Gemma 3's turn format, written for corral (the GGUF of the base model carries no template): a system
# message opens the first user turn; the assistant's role is "model"; tool results are user turns.
GEMMA3_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set system = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- if system and not turns -%}"
    "{{- '<start_of_turn>user\\n' + system | trim + '<end_of_turn>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in turns -%}"
    "{{- '<start_of_turn>' + ('model' if message['role'] == 'assistant' else 'user') + '\\n' -}}"
    "{%- if loop.first and system -%}{{- system | trim + '\\n\\n' -}}{%- endif -%}"
    "{{- (message['content'] or '') | trim + '<end_of_turn>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)
_BUILTIN_TEMPLATES = {"gemma3": GEMMA3_CHAT_TEMPLATE}
_END_OF_TURN = {"gemma3": "<end_of_turn>"}


class GGUFError(Exception):
    """The file is not a GGUF corral can serve; the message is one sentence meant for the user."""


def read_metadata(path: Path, *keys: str) -> dict[str, Any]:
    """The named metadata fields of a GGUF file (absent ones are left out); raises GGUFError on a bad file.
    Read from the header alone (corral/server/models/gguf_header.py): seconds saved per call on a large vocabulary."""
    try:
        return read_fields(path, keys)
    except (GGUFHeaderError, OSError) as exc:
        raise GGUFError(f"{path} is not a readable GGUF file: {exc}") from exc


def gguf_architecture(path: Path) -> str:
    """The file's architecture; GGUFError unless corral can serve it."""
    arch = read_metadata(path, "general.architecture").get("general.architecture")
    if not isinstance(arch, str):
        raise GGUFError(f"{path} has no general.architecture in its metadata")
    if arch not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise GGUFError(f"{path} holds a {arch!r} model; corral reads GGUF files of these architectures: {supported}")
    return arch


def convert_gguf(path: Path, header: Path, out_dir: Path, dtype: torch.dtype) -> None:
    """Write `path` as a checkpoint into `out_dir`: the files `write_gguf_header` wrote into `header` and
    model.safetensors, its weights dequantized to `dtype` (the float paths: `--quantization` other than gguf)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    for file in header.iterdir():
        if file.is_file() and file.name != "corral-build.json":
            shutil.copyfile(file, out_dir / file.name)
    config = json.loads((header / "config.json").read_text(encoding="utf-8"))
    logger.info("dequantizing the weights of %s to %s", path.name, str(dtype).removeprefix("torch."))
    try:
        with _parsed_once():
            model: Any = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    except (ValueError, OSError, KeyError, RuntimeError, TypeError) as exc:
        raise GGUFError(f"transformers could not read {path}: {str(exc).strip().splitlines()[0]}") from exc
    # Tied heads are the embedding: safetensors refuses shared storage, and the config says it is tied.
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    weights = {
        name: tensor.detach().to(dtype).contiguous()
        for name, tensor in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config["dtype"] = str(dtype).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")


def write_gguf_header(path: Path, out_dir: Path) -> dict[str, Any]:
    """Write what serving `path` needs besides its tensors into `out_dir`: config.json (from the metadata, as
    transformers maps it), the tokenizer rebuilt from its vocabulary, generation_config.json (stop ids).
    Returns the config written. A few MB, seconds to tens of seconds once (the vocabulary's parse)."""
    from transformers import AutoConfig, AutoTokenizer

    arch = gguf_architecture(path)
    template = read_metadata(path, "tokenizer.chat_template").get("tokenizer.chat_template")  # past the vocabulary
    logger.info("reading the tokenizer of %s (%s)", path.name, arch)
    try:
        with _parsed_once():
            tokenizer: Any = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            hf_config: Any = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except (ValueError, OSError, KeyError, RuntimeError, TypeError) as exc:
        raise GGUFError(f"transformers could not read {path}: {str(exc).strip().splitlines()[0]}") from exc
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = template if isinstance(template, str) else _BUILTIN_TEMPLATES.get(arch)
    config: dict[str, Any] = hf_config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [SUPPORTED_ARCHITECTURES[arch]]
    config["gguf_architecture"] = arch
    (out_dir / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    tokenizer.save_pretrained(out_dir)
    _drop_tokens_past(out_dir / "tokenizer.json", int(hf_config.get_text_config().vocab_size))
    eos = [tokenizer.eos_token_id]
    if arch in _END_OF_TURN:
        eos.append(tokenizer.convert_tokens_to_ids(_END_OF_TURN[arch]))
    eos_ids = [int(i) for i in dict.fromkeys(eos) if i is not None]
    generation = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": eos_ids}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2), encoding="utf-8")
    return config


# What `_parsed_once` blocks share inside `one_parse_per_file` (load_model: the header, then the weights): readers by
# (path, mode), and transformers' metadata walks by path.
_shared: ContextVar[tuple[dict[tuple[str, str], Any], dict[str, Any]] | None] = ContextVar("shared_gguf", default=None)


@contextmanager
def one_parse_per_file() -> Iterator[None]:
    """Inside this block every read of a GGUF through transformers shares one parse per file: loading a GGUF on
    a float path writes its config and tokenizer, then dequantizes its weights, and each would parse it again."""
    if _shared.get() is not None:
        yield
        return
    token = _shared.set(({}, {}))
    try:
        yield
    finally:
        _shared.reset(token)


@contextmanager
def _parsed_once() -> Iterator[None]:
    """transformers parses the file for the tokenizer, the config (twice when it loads weights) and the weights,
    each parse walking every vocabulary string and merge: ~10 s apiece on a 128k-token Llama 3 vocabulary. Inside
    this block it gets one reader per file (it imports `gguf.GGUFReader` and its `load_gguf_checkpoint` at call
    time and only reads from the reader), and the metadata walk without tensors is done once per file (each caller
    gets its own copy: they pop keys from it); both are shared with the other blocks of a `one_parse_per_file`."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    original = gguf.GGUFReader
    walk: Any = gguf_utils.load_gguf_checkpoint
    readers, walks = _shared.get() or ({}, {})

    def parsed(path: Any, mode: str = "r") -> Any:
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = original(path, mode)  # type: ignore[arg-type]
        return readers[key]

    def walked(path: Any, return_tensors: bool = False, model_to_load: Any = None, **kwargs: Any) -> Any:
        if return_tensors or model_to_load is not None or kwargs:
            return walk(path, return_tensors=return_tensors, model_to_load=model_to_load, **kwargs)
        key = str(Path(path).resolve())
        if key not in walks:
            walks[key] = walk(path, return_tensors=False)
        return copy.deepcopy(walks[key])

    gguf.GGUFReader = parsed  # type: ignore[misc,assignment]
    setattr(gguf_utils, "load_gguf_checkpoint", walked)  # noqa: B010 - typed as transformers' own signature
    try:
        yield
    finally:
        gguf.GGUFReader = original  # type: ignore[misc]
        setattr(gguf_utils, "load_gguf_checkpoint", walk)  # noqa: B010


def _drop_tokens_past(tokenizer_file: Path, vocab_size: int) -> None:
    """transformers' reader of GPT-2-style GGUF vocabularies appends `<|endoftext|>` when the file lacks it: a
    token the model has no logit for. Remove added tokens past the model's vocabulary."""
    data = json.loads(tokenizer_file.read_text(encoding="utf-8"))
    added = data.get("added_tokens") or []
    kept = [t for t in added if int(t.get("id", 0)) < vocab_size]
    if len(kept) != len(added):
        logger.info("dropping %d tokenizer token(s) the model has no logits for", len(added) - len(kept))
        data["added_tokens"] = kept
        tokenizer_file.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
