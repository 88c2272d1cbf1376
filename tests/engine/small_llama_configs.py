"""Small random-weight configs of every decoder variant corral's own decoder serves (Llama 3.1 RoPE scaling,
Qwen2 biases, Qwen3 q/k norms, Mistral with and without a sliding window, Gemma 3), for the tests that compare
its paths (test_decoder_equivalence.py, test_ggml_layers.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

VOCAB = 512

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


def llama3_config() -> Any:
    from transformers import LlamaConfig

    scaling = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    return LlamaConfig(**_COMMON, rope_parameters=scaling, tie_word_embeddings=False)


def qwen2_config() -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(**_COMMON, rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=True)


def qwen3_config() -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(**_COMMON, head_dim=32, tie_word_embeddings=False)


def mistral_config() -> Any:
    from transformers import MistralConfig

    return MistralConfig(**_COMMON, sliding_window=None, tie_word_embeddings=False)


def gemma3_config() -> Any:
    """Gemma 3's shape at small size: a sliding layer (window 24, shorter than the rows, so keys leave it)
    then a global one, each with its own RoPE base; a query scale that is not 1/sqrt(head_dim)."""
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        **_COMMON,
        head_dim=32,
        sliding_window=24,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=20,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        },
        tie_word_embeddings=True,
    )


def sliding_mistral_config() -> Any:
    """One window for every layer (Mistral's form), shorter than the rows."""
    from transformers import MistralConfig

    return MistralConfig(**_COMMON, sliding_window=20, tie_word_embeddings=False)


CONFIGS: dict[str, Callable[[], Any]] = {
    "llama3": llama3_config,
    "qwen2": qwen2_config,
    "qwen3": qwen3_config,
    "mistral": mistral_config,
    "mistral-sliding": sliding_mistral_config,
    "gemma3": gemma3_config,
}
