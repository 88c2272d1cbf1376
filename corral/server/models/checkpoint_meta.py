"""What a checkpoint directory says beside its weights: that it is one, its causal-LM config, tokenizer and chat
template, the tokens that end a turn, the revision token and the context length. Errors are one sentence for
the user (`ModelLoadError`)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from corral.server.models.default_model import REVISE

logger = logging.getLogger(__name__)

FALLBACK_CONTEXT_LENGTH = 2048
# Tokenizers report "no limit" as a huge sentinel (int(1e30)); anything above this is not a real length.
_MAX_SANE_CONTEXT = 10_000_000

# Used only when a checkpoint ships no chat template: plain "role: content" lines.
GENERIC_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- message['role'] + ': ' + message['content'] + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'assistant: ' -}}{%- endif -%}"
)

# Conventional end-of-turn and end-of-document markers: chat models often declare only one of them as eos, and
# would otherwise run past the end of their turn or document. Qwen2.5's GGUF declares only <|im_end|>: a raw
# completion that reached <|endoftext|> went on writing a new document (`corral bench agree` found it; transformers'
# generation config and llama.cpp's end-of-generation set both stop there).
_END_OF_TURN_TOKENS = ("<|eot_id|>", "<|end_of_text|>", "<|im_end|>", "<end_of_turn>", "<|end|>", "<|endoftext|>")


class ModelLoadError(Exception):
    """A checkpoint could not be loaded; the message is one sentence meant for the user."""



def check_checkpoint_dir(model_dir: Path) -> None:
    if not model_dir.exists():
        raise ModelLoadError(f"Model path {model_dir} does not exist.")
    if not model_dir.is_dir():
        raise ModelLoadError(f"Model path {model_dir} is not a directory.")
    if not (model_dir / "config.json").is_file():
        raise ModelLoadError(f"{model_dir} has no config.json, so it is not a Hugging Face checkpoint.")


def causal_lm_class_names() -> set[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names: set[str] = set()
    for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update([value] if isinstance(value, str) else value)
    return names


def load_causal_config(model_dir: Path) -> Any:
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        raw = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{model_dir / 'config.json'} is not valid JSON: {first_line(exc)}") from exc
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{model_dir / 'config.json'} does not hold a JSON object.")
    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        model_type = raw.get("model_type", "unknown")
        raise ModelLoadError(
            f"{model_dir} has model type {model_type!r}, which this transformers version cannot load."
        ) from exc

    # A model type with a causal head (e.g. "bert" -> BertLMHeadModel) is not enough: a checkpoint saved as
    # a bare encoder would load with a freshly random LM head. Trust the saved architecture when present.
    architectures = [str(a) for a in (getattr(config, "architectures", None) or [])]
    if architectures:
        causal = causal_lm_class_names()
        if not any(a in causal or a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures):
            raise ModelLoadError(f"{model_dir} is a {architectures[0]} checkpoint, not a causal language model.")
    elif config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelLoadError(f"{model_dir} is a {config.model_type!r} checkpoint, not a causal language model.")
    return config


def read_chat_template(path: Path) -> str:
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"Could not read the chat template {path}: {first_line(exc)}") from exc
    if not text.strip():
        raise ModelLoadError(f"The chat template {path} is empty.")
    return text


def load_tokenizer(model_dir: Path, chat_template: str | None = None) -> Any:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True, use_fast=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{model_dir} has no loadable fast tokenizer: {first_line(exc)}") from exc
    if not getattr(tokenizer, "is_fast", False):
        raise ModelLoadError(f"{model_dir} has no fast (tokenizer.json) tokenizer, which grammars need.")
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    if not getattr(tokenizer, "chat_template", None):
        logger.warning("%s has no chat template; using a generic 'role: content' template", model_dir)
        tokenizer.chat_template = GENERIC_CHAT_TEMPLATE
    return tokenizer


def as_id_list(value: object) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list | tuple):
        return [v for v in value if isinstance(v, int)]
    return []


def generation_eos(model_dir: Path) -> object:
    try:
        raw = json.loads((model_dir / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return raw.get("eos_token_id") if isinstance(raw, dict) else None


def read_stop_token_ids(model_dir: Path, config: Any, tokenizer: Any, vocab_size: int) -> tuple[int, ...]:
    candidates: list[int] = []
    candidates += as_id_list(generation_eos(model_dir))
    candidates += as_id_list(getattr(config.get_text_config(), "eos_token_id", None))
    candidates += as_id_list(tokenizer.eos_token_id)
    vocab: dict[str, int] = tokenizer.get_vocab()
    candidates += [vocab[t] for t in _END_OF_TURN_TOKENS if t in vocab]
    # dict.fromkeys: dedupe, keep first-seen order.
    return tuple(i for i in dict.fromkeys(candidates) if 0 <= i < vocab_size)


def read_revision_token_id(tokenizer: Any, revision_token: str | None) -> int | None:
    vocab: dict[str, int] = tokenizer.get_vocab()
    if revision_token is not None:
        if revision_token not in vocab:
            raise ModelLoadError(f"Revision token {revision_token!r} is not in the tokenizer's vocabulary.")
        return vocab[revision_token]
    return vocab.get(REVISE)


def read_context_length(config: Any, tokenizer: Any) -> int:
    text_config = config.get_text_config()
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(text_config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    value = getattr(tokenizer, "model_max_length", None)
    if isinstance(value, int) and 0 < value < _MAX_SANE_CONTEXT:
        return value
    return FALLBACK_CONTEXT_LENGTH


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
