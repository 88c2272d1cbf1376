"""Server settings: every `corral serve` flag is also an environment variable (CORRAL_<NAME>)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from corral.grammars.limits import InputLimits
from corral.grammars.spec import JsonWhitespace

T = TypeVar("T")

# The settings by concern, as `corral serve --help` lists them; each component takes its group's dataclass
# whole (`Settings.group`): model -> corral/server/models ModelOptions, engine -> EngineConfig, watchdog ->
# WatchdogLimits, compile -> CompileOptions, limits -> InputLimits; api is read by the HTTP layer.
GROUPS: dict[str, tuple[str, ...]] = {
    "model": (
        "model",
        "chat_template",
        "served_model_name",
        "device",
        "dtype",
        "model_impl",
        "load_format",
        "quantization",
        "revision_token",
        "torch_threads",
        "row_kernel",
        "head_screen",
    ),
    "engine": (
        "max_batch",
        "max_model_len",
        "max_queue",
        "default_max_tokens",
        "prefix_cache",
        "prefix_cache_ram_mb",
        "jump_forward",
        "lazy_masks",
        "draft_tokens",
        "max_revisions",
        "close_answers",
        "json_leading_whitespace",
        "json_whitespace",
    ),
    "compile": (
        "backends",
        "compile_timeout_s",
        "compile_workers",
        "compile_isolate",
        "compile_memory_limit_mb",
        "compile_timeout_retry_s",
    ),
    "watchdog": (
        "stall_whitespace_tokens",
        "stall_repeat_tokens",
        "mask_budget_ms",
        "mask_overruns",
        "hung_step_timeout_s",
        "exit_on_hung_step",
    ),
    "limits": (
        "max_body_bytes",
        "max_json_depth",
        "max_schema_depth",
        "max_schema_nodes",
        "max_schema_refs",
        "max_regex_length",
        "max_grammar_length",
        "max_choices",
        "max_tools",
    ),
    "api": (
        "host",
        "port",
        "api_key",
        "metrics_require_key",
        "cors_allow_origin",
        "tool_call_format",
        "finish_reasons",
        "shutdown_timeout_s",
        "log_level",
    ),
}


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CORRAL_", extra="ignore")

    model: str | None = Field(
        None,
        description="a built-in model (qwen2.5-coder-1.5b-instruct, the default: chat, tools, JSON; gemma-3-270m, "
        "a small base model, fast under a schema; corral-tiny, a tiny random model for tests), a Hugging Face "
        "causal-LM directory, or a .gguf file (served from its own blocks; its config and tokenizer written once "
        "into $CORRAL_CACHE_DIR)",
    )
    chat_template: Path | None = Field(None, description="a Jinja chat template file that replaces the model's")
    served_model_name: str | None = Field(None, description="model id reported by /v1/models")
    host: str = "127.0.0.1"
    port: int = 8000
    device: Literal["cpu", "cuda"] | None = Field(None, description="default: cuda if available, else cpu")
    dtype: str = Field("auto", description="auto | float32 | bfloat16 | float16")
    model_impl: Literal["auto", "corral", "transformers"] = Field(
        "auto",
        description="decoder: corral's own (Llama family, Gemma 3), transformers, or auto (corral where "
        "supported; on CPU only until it has run on CUDA)",
    )
    load_format: Literal["auto", "dummy"] = Field(
        "auto",
        description="dummy: random weights at the shape --model names (llama-3.1-8b, qwen2.5-7b, qwen2.5-1.5b, or a "
        "config.json), on corral-tiny's tokenizer, for speed at a real model's shape without its weights",
    )
    quantization: Literal["auto", "none", "int8", "int4", "w8a8", "fp16", "fp16-w8a8", "gguf"] = Field(
        "auto",
        description="quantization of corral's decoder on CPU, through torch's kernels: int8 weights (per output "
        "channel), int4 weights (groups of 32, int8 head), w8a8 (int8 weights; the head's inputs int8 too, "
        "fbgemm), fp16 (16-bit weights, float32 products, fbgemm), fp16-w8a8 (fp16 layers, w8a8's head), or "
        "gguf (a GGUF's own 4-8-bit blocks, memory-mapped, every step on ggml, as llama.cpp serves it; needs the "
        "ggml extra); the float modes convert a GGUF once into a checkpoint; none keeps the serving dtype; auto: "
        "gguf for a GGUF (the built-ins, FILE.gguf; fp16 without ggml), else none",
    )
    row_kernel: Literal["ggml", "products", "torch"] = Field(
        "ggml",
        description="CPU kernels of corral's decoder for steps of few rows: ggml (fp16 products and whole decode "
        "steps on ggml, where the ggml extra is installed), products (ggml for the products only), torch (no "
        "ggml); the last two for comparisons",
    )
    head_screen: bool = Field(
        True, description="greedy rows' fp16 head through an integer screen with exact error bounds (off: "
        "every row through the fp16 head, for comparisons)"
    )
    prefix_cache: bool = Field(True, description="reuse the KV of prompt prefixes already computed")
    prefix_cache_ram_mb: int = Field(
        512, ge=0, description="host memory (MiB) for prompt blocks kept after their slot is reused, found again "
        "when their prompt returns (as llama-server's --cache-ram); 0: the slots alone"
    )
    revision_token: str | None = Field(
        None, description="token text of the revision token (default: <|revise|> if present)"
    )
    max_batch: int = Field(16, ge=1, description="sequences decoded together per step")
    max_model_len: int = Field(4096, ge=16, description="prompt + output tokens per sequence")
    max_queue: int = Field(256, ge=1, description="requests waiting or running before 429")
    default_max_tokens: int = Field(512, ge=1, description="max_tokens when a request gives none")
    compile_timeout_s: float = Field(10.0, gt=0, description="grammar compile deadline")
    compile_workers: int = Field(2, ge=1, description="grammar compile worker processes (and threads)")
    compile_isolate: bool = Field(True, description="compile in killable worker processes (hard deadline)")
    compile_memory_limit_mb: int | None = Field(4096, ge=64, description="memory cap per compile worker")
    compile_timeout_retry_s: float | None = Field(
        600.0, gt=0, description="a cached compile timeout expires after this many seconds"
    )
    jump_forward: bool = Field(True, description="append grammar-forced tokens without sampling")
    lazy_masks: bool = Field(
        True,
        description="greedy rows in wide grammar states whose masks cost much skip the fill: the pick is checked "
        "against the grammar after and re-picked under the mask only if refused (the same tokens, fewer fills)",
    )
    draft_tokens: int = Field(
        8,
        ge=0,
        le=15,
        description="speculative decoding: draft tokens a greedy row may feed after its own, looked up in its prompt "
        "and answer and cut by its grammar (the answer is unchanged); each row drafts as many as its measured "
        "acceptance and step cost make worth it; 0: off (a request's drafts: false turns it off for that request)",
    )
    max_revisions: int = Field(4, ge=0, description="revisions (revision token + dead-end backtracking) per request")
    close_answers: bool = Field(
        True,
        description="end a JSON Schema or tool-call answer with its shortest valid completion when max_tokens or "
        "the context would cut it, or the model runs away (a request's close_answers overrides)",
    )
    json_leading_whitespace: bool = Field(
        False,
        description="let a JSON answer start with one space or newline, as a model writes ` {` after `JSON:` "
        "(the value is unchanged). Off by default: the answer starts at its first bracket or quote, which "
        "measured better on Gemma 3; a request's json_leading_whitespace overrides",
    )
    json_whitespace: JsonWhitespace = Field(
        "fixed",
        description="whitespace inside a JSON answer: fixed (one line, \", \" and \": \" only) or free (the "
        "model's own layout, each gap between two tokens bounded: a space, or one or two newlines and an indent of "
        "up to 20; on xgrammar any 22 whitespace characters); a request's json_whitespace overrides",
    )
    stall_whitespace_tokens: int = Field(
        64, ge=0, description="whitespace-only tokens in a row that end a request; 0: off"
    )
    stall_repeat_tokens: int = Field(64, ge=0, description="tokens repeating a short cycle that end a request; 0: off")
    mask_budget_ms: float = Field(50.0, gt=0, description="per-row mask fill budget per step")
    mask_overruns: int = Field(8, ge=0, description="mask budget overruns tolerated per request")
    hung_step_timeout_s: float = Field(
        60.0, gt=0, description="one engine step longer than this (this long for every 512 tokens it computes, for a "
        "long prompt) marks the server unhealthy"
    )
    exit_on_hung_step: bool = Field(
        True, description="exit (for a supervisor to restart) after failing in-flight requests of a hung step"
    )
    shutdown_timeout_s: int = Field(
        5, ge=0, description="on SIGINT/SIGTERM, how long in-flight requests may still finish before they are cut"
    )
    torch_threads: int | None = Field(
        None,
        ge=1,
        description="CPU threads for the model (default: all cores but one, or all of them, chosen per forward "
        "by measured time)",
    )
    tool_call_format: Literal["auto", "llama3_json", "hermes", "mistral"] = Field(
        "auto", description="how the model writes tool calls; auto: from its chat template (default model: llama3_json)"
    )
    finish_reasons: Literal["openai", "precise"] = Field(
        "openai",
        description="openai: finish_reason stays in OpenAI's enum (failures read as length/content_filter) with "
        "the precise reason in corral_finish_reason; precise: finish_reason is corral's own reason",
    )
    api_key: str | None = Field(
        None, description="require `Authorization: Bearer <key>` on /v1/*; repeat the flag (or comma-separate)"
    )
    metrics_require_key: bool = Field(False, description="require an API key on /metrics too")
    backends: str = Field("xgrammar,llguidance", description="enabled grammar backends, comma-separated")
    # Request limits (docs/reliability.md), each checked before the work it bounds.
    max_body_bytes: int = Field(
        4 * 1024 * 1024, ge=1, description="request body size; larger is a 413, refused while it is read"
    )
    max_json_depth: int = Field(160, ge=8, description="nesting depth of a request body (JSON); deeper is a 400")
    max_schema_depth: int = Field(128, ge=2, description="nesting depth of one JSON Schema document")
    max_schema_nodes: int = Field(100_000, ge=1, description="JSON values in one JSON Schema document")
    max_schema_refs: int = Field(5_000, ge=0, description="$ref keywords in one JSON Schema document")
    max_regex_length: int = Field(10_000, ge=1, description="characters of a regex constraint")
    max_grammar_length: int = Field(100_000, ge=1, description="characters of an EBNF/GBNF or Lark grammar")
    max_choices: int = Field(10_000, ge=1, description="options of one choice constraint")
    max_tools: int = Field(128, ge=1, description="functions in a request's tools")
    cors_allow_origin: str | None = Field(
        None, description="allow browser requests from this origin (CORS; off by default); repeat the flag"
    )
    log_level: str = "info"

    @field_validator("model", mode="before")
    @classmethod
    def _empty_model_is_default(cls, value: object) -> object:
        # CORRAL_MODEL= (set but empty) means the default model, not the current directory.
        return None if isinstance(value, str) and not value.strip() else value

    def group(self, options: type[T], **given: Any) -> T:
        """A component's options (a dataclass whose fields are named as these settings) from these settings,
        handed over whole; `given` fills fields that are no setting (e.g. what the loaded model decides)."""
        names = [f.name for f in dataclasses.fields(options)]  # type: ignore[arg-type]  # T is a dataclass
        taken = {name: getattr(self, name) for name in names if name in type(self).model_fields}
        return options(**taken, **given)

    def input_limits(self) -> InputLimits:
        """The request limits on constraints (corral/grammars/limits.py)."""
        return self.group(InputLimits)

    def api_keys(self) -> frozenset[str]:
        return frozenset(k.strip() for k in (self.api_key or "").split(",") if k.strip())

    def cors_origins(self) -> list[str]:
        return [o.strip() for o in (self.cors_allow_origin or "").split(",") if o.strip()]

    def backend_list(self) -> list[str]:
        return [b.strip() for b in self.backends.split(",") if b.strip()]

    def cpu_thread_choices(self) -> tuple[int, ...]:
        return cpu_thread_choices(self.torch_threads)


def cpu_thread_choices(torch_threads: int | None = None) -> tuple[int, ...]:
    """The counts the engine chooses among per forward (corral/server/engine/thread_tuner.py): all cores but one
    (when masks or HTTP want a core) and all cores (when the other core is free); just `torch_threads` when it
    is set."""
    if torch_threads:
        return (torch_threads,)
    cores = os.cpu_count() or 1
    return tuple(dict.fromkeys((default_cpu_threads(), cores)))


def default_cpu_threads() -> int:
    """All cores but one: the engine thread's torch ops leave a core to the mask thread and HTTP (on 2 loaded
    cores a step ran about four times faster on 1 thread than on 2: docs/measured-choices.md#torch-threads)."""
    return max(1, (os.cpu_count() or 2) - 1)


def cache_dir() -> Path:
    """Where corral keeps what it builds once (reassembled built-in models, the tiny test model, GGUF headers):
    `$CORRAL_CACHE_DIR`, else ~/.cache/corral. Read from the environment, not a flag: tests, benchmarks and
    `docker build` build models before any server's settings exist."""
    env = os.environ.get("CORRAL_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "corral"
