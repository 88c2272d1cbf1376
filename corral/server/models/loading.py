"""Load a local Hugging Face causal-LM checkpoint (or the embedded default) for serving, strictly offline."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from corral.kernels.choice import KernelOptions, RowKernel, use_kernels
from corral.kernels.quantized_projection import FBGEMM_MODES, QUANTIZATIONS, Quantization, fbgemm_available
from corral.kernels.row_kernel import layer_graphs_available
from corral.server.models.builtin import UnresolvedModel, resolve_model
from corral.server.models.checkpoint_meta import (
    ModelLoadError,
    check_checkpoint_dir,
    first_line,
    load_causal_config,
    load_tokenizer,
    read_chat_template,
    read_context_length,
    read_revision_token_id,
    read_stop_token_ids,
)
from corral.server.models.gguf_import import one_parse_per_file

AUTO_QUANTIZATION: Quantization = "fp16"
AUTO_WITHOUT_FBGEMM: Quantization = "int8"  # torch's own kernel, in every CPU build


logger = logging.getLogger(__name__)

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: Any  # transformers.PreTrainedTokenizerFast (untyped library)
    path: Path
    name: str
    vocab_size: int
    stop_token_ids: tuple[int, ...]
    revision_token_id: int | None
    context_length: int
    device: torch.device
    dtype: torch.dtype
    impl: str = "transformers"  # which decoder runs it: "corral" (corral/server/models/llama_family.py) or
    "transformers"
    quantization: str = "none"  # the decoder's quantization (corral/kernels/quantized_projection.py)


@dataclass(frozen=True)
class ModelOptions:
    """`load_model`'s arguments as one object: the server settings of the same names (Settings.group)."""

    model: str | None = None
    device: str | None = None
    dtype: str = "auto"
    revision_token: str | None = None
    model_impl: str = "auto"
    chat_template: Path | None = None
    quantization: str = "auto"
    row_kernel: RowKernel = "ggml"
    head_screen: bool = True
    load_format: str = "auto"


def load_model(
    model: str | Path | None,
    device: str | None = None,
    dtype: str | None = None,
    revision_token: str | None = None,
    model_impl: str = "auto",
    chat_template: Path | None = None,
    quantization: str = "auto",
    row_kernel: RowKernel = "ggml",
    head_screen: bool = True,
    load_format: str = "auto",
) -> LoadedModel:
    """Load a causal LM and its fast tokenizer. `model`: a built-in name (corral/server/models/builtin.py; None is the
    default), a local checkpoint directory, or a .gguf file.

    model_impl: "corral" (the Llama family and Gemma 3), "transformers", or "auto" (corral when it supports the
    architecture). chat_template: a Jinja file that replaces the model's own template. quantization: "gguf" (a
    GGUF served from its own blocks on ggml, every step: corral/server/models/gguf_decoder.py), "none", "int8", "int4",
    "w8a8", "fp16" or "fp16-w8a8" (corral/kernels/quantized_projection.py, over a checkpoint of dequantized
    weights for a GGUF), or "auto": gguf for a GGUF on CPU (fp16 without ggml), none for a checkpoint.
    row_kernel, head_screen: the CPU kernels its steps use (corral/kernels/choice.py). load_format "dummy":
    `model` names a shape and the weights are random (corral/server/models/dummy_weights.py)."""
    use_kernels(KernelOptions(row_kernel, head_screen))
    torch_device = _resolve_device(device)
    dtype_arg = _resolve_dtype(dtype, torch_device)
    template = read_chat_template(chat_template) if chat_template is not None else None
    if load_format == "dummy":
        return _load_dummy(model, torch_device, dtype_arg, model_impl, quantization, template, revision_token)
    if load_format != "auto":
        raise ModelLoadError(f"Unknown load format {load_format!r}; choose auto or dummy.")
    with one_parse_per_file():  # a GGUF's config and tokenizer, then its float copy, from one parse of the file
        try:
            resolved = resolve_model(model)
        except UnresolvedModel as exc:
            raise ModelLoadError(f"{exc}.") from exc
        check_checkpoint_dir(resolved.path)
        config = load_causal_config(resolved.path)
        tokenizer = load_tokenizer(resolved.path, template)
        # Checked before the (slow) weight load so a bad flag fails fast.
        revision_token_id = read_revision_token_id(tokenizer, revision_token)
        impl = _choose_impl(model_impl, config, torch_device)
        quantized = _check_quantization(quantization, impl, torch_device, resolved.from_gguf)
        model_dir = resolved.path
        if quantized != "gguf" and resolved.converted is not None:
            # A GGUF's float paths: its weights dequantized to the serving dtype, the one asked for, else the
            # device's default.
            convert_to = dtype_arg if isinstance(dtype_arg, torch.dtype) else _resolve_dtype(None, torch_device)
            assert isinstance(convert_to, torch.dtype)
            try:
                model_dir = resolved.converted(convert_to)
            except UnresolvedModel as exc:
                raise ModelLoadError(f"{exc}.") from exc

    network: Any  # transformers' stubs are partial; treat the model as Any at this boundary
    if quantized == "gguf":
        assert resolved.gguf is not None
        network = _load_gguf(resolved.gguf, config)
        model_dtype = torch.float32
    else:
        if impl == "corral":
            network = _load_corral(model_dir, config, dtype_arg, torch_device, quantized)
        else:
            network = _load_transformers(model_dir, config, dtype_arg, torch_device)
        model_dtype = next(network.parameters()).dtype

    vocab_size = int(network.config.get_text_config().vocab_size)
    if len(tokenizer) > vocab_size:
        raise ModelLoadError(
            f"The tokenizer in {model_dir} has {len(tokenizer)} tokens but the model has only {vocab_size} logits."
        )
    return LoadedModel(
        model=network,
        tokenizer=tokenizer,
        path=model_dir,
        name=resolved.name,
        vocab_size=vocab_size,
        stop_token_ids=read_stop_token_ids(resolved.path, network.config, tokenizer, vocab_size),
        revision_token_id=revision_token_id,
        context_length=read_context_length(network.config, tokenizer),
        device=torch_device,
        dtype=model_dtype,
        impl=impl,
        quantization=quantized,
    )


def _load_dummy(
    model: str | Path | None,
    device: torch.device,
    dtype_arg: torch.dtype | str,
    model_impl: str,
    quantization: str,
    template: str | None,
    revision_token: str | None,
) -> LoadedModel:
    """Random weights at the shape `model` names, on corral-tiny's tokenizer (dummy_weights.py)."""
    from corral.server.models.builtin import TINY
    from corral.server.models.dummy_weights import dummy_config, dummy_weights

    if model is None:
        raise ModelLoadError("--load-format dummy needs --model to name a shape or a config.json.")
    try:
        config = dummy_config(model)
    except ValueError as exc:
        raise ModelLoadError(f"{exc}.") from exc
    tokenizer_dir = resolve_model(TINY).path
    tokenizer = load_tokenizer(tokenizer_dir, template)
    text = config.get_text_config()
    if len(tokenizer) > int(text.vocab_size):
        # corral-tiny's tokenizer holds 128,257 tokens, Llama 3.1's head 128,256 rows: the head grows to fit.
        logger.info("dummy %s: vocabulary %d -> %d rows (the tokenizer's)", model, text.vocab_size, len(tokenizer))
        text.vocab_size = len(tokenizer)
    revision_token_id = read_revision_token_id(tokenizer, revision_token)
    impl = _choose_impl(model_impl, config, device)
    quantized = _check_quantization(quantization, impl, device, from_gguf=False)
    dtype = dtype_arg if isinstance(dtype_arg, torch.dtype) else _resolve_dtype(None, device)
    assert isinstance(dtype, torch.dtype)
    weights = dummy_weights(config, dtype, device)
    network: Any
    if impl == "corral":
        from corral.server.models.llama_family import llama_family_from_weights

        network = llama_family_from_weights(text, weights, quantized)
    else:
        from transformers import AutoModelForCausalLM

        with torch.device(device):
            network = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
                config, dtype=dtype, attn_implementation="sdpa"
            )
        loaded = network.load_state_dict(weights, strict=False, assign=True)
        network.tie_weights()  # assign=True replaced the embedding: a tied head must point at the new one
        missing = [k for k in loaded.missing_keys if k != "lm_head.weight" or not text.tie_word_embeddings]
        if missing or loaded.unexpected_keys:
            raise ModelLoadError(f"the dummy weights do not fit transformers' {type(network).__name__}: missing "
                                 f"{missing[:3]}, unexpected {loaded.unexpected_keys[:3]}.")
        network.eval()
    vocab_size = int(network.config.get_text_config().vocab_size)
    name = str(model) if isinstance(model, str) and "/" not in model else Path(model).stem
    return LoadedModel(
        model=network, tokenizer=tokenizer, path=tokenizer_dir, name=f"dummy-{name}", vocab_size=vocab_size,
        stop_token_ids=read_stop_token_ids(tokenizer_dir, network.config, tokenizer, vocab_size),
        revision_token_id=revision_token_id, context_length=read_context_length(network.config, tokenizer),
        device=device, dtype=dtype, impl=impl, quantization=quantized,
    )


# Devices where `auto` serves with corral's own decoder: no path is the default on a device it has not been
# measured best on. On CUDA it ran correct but slower than transformers (docs/models.md, "On CUDA").
OWN_DECODER_VERIFIED_DEVICES = frozenset({"cpu"})


def _choose_impl(model_impl: str, config: Any, device: torch.device) -> str:
    from corral.server.models.decoder_config import unsupported_reason

    if model_impl not in ("auto", "corral", "transformers"):
        raise ModelLoadError(f"Unknown model implementation {model_impl!r}; choose auto, corral or transformers.")
    if model_impl == "transformers":
        return "transformers"
    if model_impl == "auto" and device.type not in OWN_DECODER_VERIFIED_DEVICES:
        logger.info(
            "serving with transformers: corral's own decoder is not the default on %s "
            "(--model-impl corral forces it)",
            device.type,
        )
        return "transformers"
    reason = unsupported_reason(config.get_text_config())
    if reason is None:
        return "corral"
    if model_impl == "corral":
        raise ModelLoadError(f"corral's own decoder cannot run this model: {reason}; use --model-impl transformers.")
    logger.info("serving with transformers: %s", reason)
    return "transformers"


def _check_quantization(quantization: str, impl: str, device: torch.device, from_gguf: bool) -> Quantization:
    if quantization == "auto":
        # A GGUF is served as llama.cpp serves it, from its own blocks (its weights were rounded to 4-8 bits
        # already; a float copy would take 2-4x the memory). Without ggml, fp16 (measured float32's accuracy on
        # Gemma 3 270M, docs/models.md). A safetensors checkpoint keeps its dtype.
        applies = from_gguf and impl == "corral" and device.type == "cpu"
        if not applies:
            return "none"
        if layer_graphs_available():
            return "gguf"
        return AUTO_QUANTIZATION if fbgemm_available() else AUTO_WITHOUT_FBGEMM
    if quantization not in QUANTIZATIONS:
        choices = ", ".join(("auto", *QUANTIZATIONS))
        raise ModelLoadError(f"Unknown quantization {quantization!r}; choose {choices}.")
    if quantization != "none" and impl != "corral":
        raise ModelLoadError(
            f"--quantization {quantization} needs corral's own decoder (Llama family, Gemma 3), which does not "
            "serve this model here; use --quantization none."
        )
    if quantization in FBGEMM_MODES and not fbgemm_available():
        raise ModelLoadError(
            f"--quantization {quantization} runs fbgemm's kernels, which this build of torch lacks "
            "(x86 builds carry them); use --quantization int8."
        )
    if quantization != "none" and device.type != "cpu":
        raise ModelLoadError(
            f"--quantization {quantization} runs torch's CPU kernels; on {device.type} use --quantization none."
        )
    if quantization == "gguf" and not from_gguf:
        raise ModelLoadError(
            "--quantization gguf serves a GGUF's own quantized blocks; this model is not a GGUF file (serve a .gguf, "
            "or a built-in model)."
        )
    if quantization == "gguf" and not layer_graphs_available():
        raise ModelLoadError(
            "--quantization gguf multiplies the GGUF's blocks with ggml, which is not installed or is turned off "
            "(pip install -e '.[ggml]'; CORRAL_ROW_KERNEL must not say torch or products)."
        )
    return quantization


def _load_gguf(path: Path, config: Any) -> Any:
    from corral.server.models.gguf_decoder import load_gguf_decoder
    from corral.server.models.gguf_file import GGUFTensorError

    try:
        from corral.server.models.gguf_import import gguf_architecture

        return load_gguf_decoder(path, config, gguf_architecture(path))
    except (GGUFTensorError, OSError, ValueError) as exc:
        raise ModelLoadError(f"Could not serve {path.name} from its blocks: {first_line(exc)}") from exc


def _load_corral(
    model_dir: Path,
    config: Any,
    dtype: torch.dtype | str,
    device: torch.device,
    quantization: Quantization,
) -> Any:
    from corral.server.models.checkpoint import CheckpointError
    from corral.server.models.llama_family import load_llama_family

    text_config = config.get_text_config()
    if dtype == "auto":
        saved = getattr(text_config, "dtype", None) or getattr(config, "dtype", None)
        dtype = saved if isinstance(saved, torch.dtype) else _DTYPES.get(str(saved), torch.float32)
    assert isinstance(dtype, torch.dtype)
    try:
        model = load_llama_family(model_dir, text_config, dtype, device, quantization)
    except (CheckpointError, OSError, ValueError, RuntimeError) as exc:
        raise ModelLoadError(f"Could not load model weights from {model_dir}: {first_line(exc)}") from exc
    return model


def _load_transformers(model_dir: Path, config: Any, dtype_arg: torch.dtype | str, torch_device: torch.device) -> Any:
    from transformers import AutoModelForCausalLM

    model: Any  # transformers' stubs are partial; treat the model as Any at this boundary
    try:
        model = AutoModelForCausalLM.from_pretrained(
            model_dir,
            config=config,
            dtype=dtype_arg,
            attn_implementation="sdpa",
            local_files_only=True,
        )
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise ModelLoadError(f"Could not load model weights from {model_dir}: {first_line(exc)}") from exc
    try:
        model.to(torch_device)
    except (RuntimeError, AssertionError) as exc:
        raise ModelLoadError(f"Could not move the model to {torch_device}: {first_line(exc)}") from exc
    model.eval()
    return model


def _resolve_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ModelLoadError(f"Unknown device {device!r}.") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"Device {device!r} was requested but CUDA is not available.")
    return resolved


def _resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype | str:
    if dtype is None:
        # bfloat16 halves memory and is fast on GPUs; CPUs are slow and less exact in it.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype == "auto":
        return "auto"
    if dtype not in _DTYPES:
        choices = ", ".join(["auto", *_DTYPES])
        raise ModelLoadError(f"Unknown dtype {dtype!r}; choose one of {choices}.")
    return _DTYPES[dtype]
