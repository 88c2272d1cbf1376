"""The tokenizer masks are computed over: the default model's, or any local Hugging Face tokenizer."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from corral.grammar_engines.protocol import TokenizerSpec

# Chat-template end-of-turn tokens that also stop generation (Llama-3 style and ChatML).
_END_OF_TURN = ("<|eot_id|>", "<|end_of_text|>", "<|im_end|>", "<|endoftext|>")


@lru_cache(maxsize=2)  # tokenizer tables are big; reuse them across runs in one process (tests)
def load_tokenizer_spec(directory: Path | None) -> TokenizerSpec:
    """None: the tiny model's (corral-tiny) tokenizer, exactly as `corral serve` sees it (vocab incl.
    `<|revise|>`, its stop tokens). A directory: its tokenizer, with the logits width from
    config.json when present (models often pad the vocabulary)."""
    if directory is None:
        from corral.server.models import load_model

        loaded = load_model("corral-tiny", device="cpu")
        return TokenizerSpec(loaded.tokenizer, loaded.vocab_size, loaded.stop_token_ids)
    from transformers import AutoTokenizer

    if not directory.is_dir():
        raise ValueError(f"--tokenizer {directory} is not a directory")
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True, use_fast=True)
    vocab_size = max(len(tokenizer), _config_vocab_size(directory))
    vocab: dict[str, int] = tokenizer.get_vocab()
    stops = [tokenizer.eos_token_id] if isinstance(tokenizer.eos_token_id, int) else []
    stops += [vocab[t] for t in _END_OF_TURN if t in vocab]
    return TokenizerSpec(tokenizer, vocab_size, tuple(dict.fromkeys(stops)))


def _config_vocab_size(directory: Path) -> int:
    path = directory / "config.json"
    if not path.exists():
        return 0
    config: Any = json.loads(path.read_text(encoding="utf-8"))
    text_config = config.get("text_config", config) if isinstance(config, dict) else {}
    size = text_config.get("vocab_size", 0) if isinstance(text_config, dict) else 0
    return size if isinstance(size, int) else 0
