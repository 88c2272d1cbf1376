"""Every request field of OpenAI's Chat Completions, Completions and Responses APIs and of vLLM's extensions,
and what corral does with each. The request models screen incoming bodies through `screen` before validation: a
field not listed here, or one corral does not implement (unless its value changes nothing), is a 400 naming it.

`docs/api.md` carries `markdown_table()`'s output; a test keeps the two identical.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from corral.server.errors import bad_request


class Treatment(StrEnum):
    HONOURED = "honoured"  # implemented
    MAPPED = "mapped"  # an older name, translated onto the field corral implements
    IGNORED = "ignored"  # accepted and dropped: ignoring it cannot change the answer
    REFUSED = "refused"  # a 400 naming it, unless its value is one that changes nothing (`neutral`)


class Endpoint(StrEnum):
    CHAT = "chat"
    COMPLETIONS = "completions"
    RESPONSES = "responses"


BOTH = frozenset({Endpoint.CHAT, Endpoint.COMPLETIONS})  # the two completions APIs
ALL = frozenset(Endpoint)
CHAT = frozenset({Endpoint.CHAT})
COMPLETIONS = frozenset({Endpoint.COMPLETIONS})
RESPONSES = frozenset({Endpoint.RESPONSES})
CHAT_RESPONSES = frozenset({Endpoint.CHAT, Endpoint.RESPONSES})


@dataclass(frozen=True)
class FieldRule:
    name: str  # a top-level field, or `parent.child` for a key inside an object-valued field
    origin: str  # OpenAI | vLLM | corral
    treatment: Treatment
    note: str
    endpoints: frozenset[Endpoint] = BOTH
    neutral: tuple[Any, ...] = ()  # values of a refused field that are what corral does anyway


H, M, IGN, R = Treatment.HONOURED, Treatment.MAPPED, Treatment.IGNORED, Treatment.REFUSED
OPENAI, VLLM, CORRAL = "OpenAI", "vLLM", "corral"

FIELDS: tuple[FieldRule, ...] = (
    # -- OpenAI, both endpoints ------------------------------------------------------------------------------
    FieldRule("model", OPENAI, H, "must name the served model (or `default`); another name is a 404", ALL),
    FieldRule("max_tokens", OPENAI, H, "more than the context leaves after the prompt is a 400"),
    FieldRule("temperature", OPENAI, H, "0..2; 0 is greedy", ALL),
    FieldRule("top_p", OPENAI, H, "(0, 1]", ALL),
    FieldRule("seed", OPENAI, H, "same seed, same request, same answer", ALL),
    FieldRule("stop", OPENAI, H, "string or list; the answer is cut before the first match"),
    FieldRule("n", OPENAI, H, "1..16 independent answers"),
    FieldRule("presence_penalty", OPENAI, H, "-2..2"),
    FieldRule("frequency_penalty", OPENAI, H, "-2..2"),
    FieldRule("logit_bias", OPENAI, H, "token id -> -100..100"),
    FieldRule("stream", OPENAI, H, "server-sent events", ALL),
    FieldRule("stream_options", OPENAI, H, "an object; its keys are listed below"),
    FieldRule("stream_options.include_usage", OPENAI, H, "a last chunk with `usage`"),
    FieldRule("stream_options.include_obfuscation", OPENAI, IGN, "a padding field against side channels"),
    FieldRule(
        "stream_options.continuous_usage_stats", VLLM, R, "`usage` on every chunk is not implemented",
        neutral=(False,),
    ),
    FieldRule("user", OPENAI, IGN, "an end-user id for abuse monitoring", ALL),
    FieldRule("logprobs", OPENAI, H, "chat: a boolean; completions: 0..5 top alternatives per token"),
    # -- OpenAI, chat only --------------------------------------------------------------------------------
    FieldRule("messages", OPENAI, H, "text content only; an image/audio/file part is a 400 naming it", CHAT),
    FieldRule("max_completion_tokens", OPENAI, H, "as `max_tokens` (wins when both are given)"),
    FieldRule("top_logprobs", OPENAI, H, "0..20 alternatives per token, with `logprobs: true`", CHAT),
    FieldRule("response_format", OPENAI, H, "`text` (the default), `json_object`, `json_schema`"),
    FieldRule("tools", OPENAI, H, "function tools; arguments generated under each tool's `parameters`", CHAT_RESPONSES),
    FieldRule("tool_choice", OPENAI, H, "`none`, `auto`, `required` or a named function", CHAT_RESPONSES),
    FieldRule("parallel_tool_calls", OPENAI, H, "whether one answer may carry several calls", CHAT_RESPONSES),
    FieldRule("metadata", OPENAI, IGN, "key-value tags for OpenAI's stored completions", CHAT_RESPONSES),
    FieldRule("store", OPENAI, IGN, "whether OpenAI stores the completion; corral stores nothing", CHAT),
    FieldRule("service_tier", OPENAI, IGN, "OpenAI's billing/latency tier; corral has one", CHAT_RESPONSES),
    FieldRule("prompt_cache_key", OPENAI, IGN, "a routing hint for OpenAI's prompt cache", CHAT_RESPONSES),
    FieldRule("prompt_cache_retention", OPENAI, IGN, "how long OpenAI keeps a cached prefix", CHAT_RESPONSES),
    FieldRule("prompt_cache_options", OPENAI, IGN, "breakpoints for OpenAI's prompt cache", CHAT_RESPONSES),
    FieldRule("safety_identifier", OPENAI, IGN, "an end-user id for abuse monitoring", CHAT_RESPONSES),
    FieldRule("modalities", OPENAI, R, "output is text only", CHAT, neutral=(["text"],)),
    FieldRule("audio", OPENAI, R, "audio output is not implemented", CHAT),
    FieldRule("prediction", OPENAI, R, "predicted outputs are not implemented", CHAT),
    FieldRule("reasoning_effort", OPENAI, R, "the model does not reason", CHAT),
    FieldRule("verbosity", OPENAI, R, "not implemented; it would change the answer's length", CHAT),
    FieldRule("web_search_options", OPENAI, R, "web search is not implemented", CHAT),
    FieldRule("moderation", OPENAI, R, "moderation is not implemented", CHAT),
    FieldRule("functions", OPENAI, R, "deprecated; use `tools`", CHAT),
    FieldRule("function_call", OPENAI, R, "deprecated; use `tool_choice`", CHAT),
    # -- OpenAI, Responses API only (POST /v1/responses) -------------------------------------------------------
    FieldRule("input", OPENAI, H, "a string, or message, `function_call` and `function_call_output` items; "
              "text parts only", RESPONSES),
    FieldRule("instructions", OPENAI, H, "a system message before `input`", RESPONSES),
    FieldRule("max_output_tokens", OPENAI, H, "as chat's `max_completion_tokens`", RESPONSES),
    FieldRule("text", OPENAI, H, "an object; its keys are listed below", RESPONSES),
    FieldRule("text.format", OPENAI, H, "`text` (the default), `json_object`, `json_schema` (as chat's "
              "`response_format`)", RESPONSES),
    FieldRule("text.verbosity", OPENAI, R, "not implemented; it would change the answer's length", RESPONSES,
              neutral=("medium",)),
    FieldRule("stream_options", OPENAI, IGN, "its one key, `include_obfuscation`, pads events against side "
              "channels", RESPONSES),
    FieldRule("include", OPENAI, H, "`message.output_text.logprobs` (each text token's logprob, with "
              "`top_logprobs` alternatives); any other value is a 400 naming it", RESPONSES),
    FieldRule("store", OPENAI, R, "corral stores no response to fetch or continue later", RESPONSES,
              neutral=(False,)),
    FieldRule("previous_response_id", OPENAI, R, "corral keeps no state between requests; send the whole "
              "conversation in `input`", RESPONSES),
    FieldRule("conversation", OPENAI, R, "corral keeps no conversations; send the whole conversation in `input`",
              RESPONSES),
    FieldRule("background", OPENAI, R, "background responses are not implemented", RESPONSES, neutral=(False,)),
    FieldRule("prompt", OPENAI, R, "stored prompt templates are not implemented; send `instructions`", RESPONSES),
    FieldRule("reasoning", OPENAI, R, "the model does not reason", RESPONSES, neutral=({},)),
    FieldRule("truncation", OPENAI, R, "the input is never truncated; a long one is a 400", RESPONSES,
              neutral=("disabled",)),
    FieldRule("top_logprobs", OPENAI, H, "0..20 alternatives per token; asks for logprobs as `include` does",
              RESPONSES),
    FieldRule("max_tool_calls", OPENAI, R, "a limit on hosted tool calls; corral has no hosted tools", RESPONSES),
    FieldRule("context_management", OPENAI, R, "server-side compaction is not implemented", RESPONSES),
    # -- OpenAI, completions only ---------------------------------------------------------------------------
    FieldRule("prompt", OPENAI, H, "one string (or a list of one)", COMPLETIONS),
    FieldRule("echo", OPENAI, R, "echoing the prompt is not implemented", COMPLETIONS, neutral=(False,)),
    FieldRule("suffix", OPENAI, R, "insertion is not implemented", COMPLETIONS, neutral=("",)),
    FieldRule("best_of", OPENAI, R, "server-side best-of is not implemented; use `n`", BOTH, neutral=(1,)),
    # -- vLLM sampling extensions ---------------------------------------------------------------------------
    FieldRule("top_k", VLLM, H, "-1 or 0: off", ALL),
    FieldRule("min_p", VLLM, H, "0..1", ALL),
    FieldRule("repetition_penalty", VLLM, H, "(0, 10]; 1 is off", ALL),
    FieldRule("ignore_eos", VLLM, H, "keep generating past end-of-turn (benchmarks); turns stall detection off"),
    FieldRule(
        "structured_outputs", VLLM, H, "the constraint: json, json_object, choice, regex, grammar, backend", ALL
    ),
    FieldRule("use_beam_search", VLLM, R, "beam search is not implemented", neutral=(False,)),
    FieldRule("length_penalty", VLLM, R, "beam search is not implemented", neutral=(1, 1.0)),
    FieldRule("min_tokens", VLLM, R, "a minimum length is not implemented", neutral=(0,)),
    FieldRule("stop_token_ids", VLLM, R, "stop token ids are not implemented; use `stop`", neutral=([],)),
    FieldRule("include_stop_str_in_output", VLLM, R, "the stop string is always cut", neutral=(False,)),
    FieldRule("skip_special_tokens", VLLM, R, "special tokens are always skipped", neutral=(True,)),
    FieldRule("spaces_between_special_tokens", VLLM, R, "special tokens are always skipped", neutral=(True,)),
    FieldRule("truncate_prompt_tokens", VLLM, R, "prompts are never truncated; a long one is a 400"),
    FieldRule("prompt_logprobs", VLLM, R, "prompt logprobs are not implemented"),
    FieldRule("allowed_token_ids", VLLM, R, "use `logit_bias` or a constraint"),
    FieldRule("bad_words", VLLM, R, "use `logit_bias` or a constraint", neutral=([],)),
    FieldRule("logits_processors", VLLM, R, "custom logits processors are not implemented"),
    FieldRule("return_tokens_as_token_ids", VLLM, R, "not implemented", neutral=(False,)),
    FieldRule("return_token_ids", VLLM, R, "not implemented", neutral=(False,)),
    FieldRule("priority", VLLM, R, "requests are served first come, first served", neutral=(0,)),
    FieldRule("request_id", VLLM, IGN, "corral assigns its own id; the answer does not depend on it"),
    FieldRule("cache_salt", VLLM, R, "the prefix cache is not salted per tenant"),
    FieldRule("kv_transfer_params", VLLM, R, "disaggregated serving is not implemented"),
    FieldRule("vllm_xargs", VLLM, R, "vLLM's custom extension arguments are not implemented", neutral=({},)),
    FieldRule("structural_tag", VLLM, R, "structural tags are not implemented; use `tools`"),
    FieldRule("add_special_tokens", VLLM, R, "the prompt's special tokens are the chat template's", CHAT,
              neutral=(False,)),
    FieldRule("add_special_tokens", VLLM, R, "the tokenizer's BOS is always added", COMPLETIONS, neutral=(True,)),
    FieldRule("prompt_embeds", VLLM, R, "prompt embeddings are not implemented", COMPLETIONS),
    # -- vLLM chat extensions --------------------------------------------------------------------------------
    FieldRule("echo", VLLM, R, "echoing the last message is not implemented", CHAT, neutral=(False,)),
    FieldRule("add_generation_prompt", VLLM, R, "the generation prompt is always added", CHAT, neutral=(True,)),
    FieldRule("continue_final_message", VLLM, R, "continuing a message is not implemented", CHAT,
              neutral=(False,)),
    FieldRule("documents", VLLM, R, "RAG documents for the template are not implemented", CHAT, neutral=([],)),
    FieldRule("chat_template", VLLM, R, "the model's own chat template is used", CHAT),
    FieldRule("chat_template_kwargs", VLLM, R, "template arguments are not implemented", CHAT, neutral=({},)),
    FieldRule("mm_processor_kwargs", VLLM, R, "the model is text-only", CHAT, neutral=({},)),
    FieldRule("include_reasoning", VLLM, IGN, "the model produces no reasoning to include or leave out", CHAT),
    # -- vLLM's older constraint names (before `structured_outputs`) -------------------------------------------
    FieldRule("guided_json", VLLM, M, "-> `structured_outputs.json`"),
    FieldRule("guided_json_object", VLLM, M, "-> `structured_outputs.json_object`"),
    FieldRule("guided_choice", VLLM, M, "-> `structured_outputs.choice`"),
    FieldRule("guided_regex", VLLM, M, "-> `structured_outputs.regex`"),
    FieldRule("guided_grammar", VLLM, M, "-> `structured_outputs.grammar`"),
    FieldRule("guided_decoding_backend", VLLM, M, "-> `structured_outputs.backend`"),
    FieldRule("guided_whitespace_pattern", VLLM, R, "a custom JSON whitespace pattern is not implemented"),
    # -- corral -----------------------------------------------------------------------------------------------
    FieldRule("max_revisions", CORRAL, H, "revision depth limit for this request", ALL),
    FieldRule(
        "close_answers",
        CORRAL,
        H,
        "false: a JSON Schema or tool-call answer the budget cuts is not closed early (default: the server's "
        "`--close-answers`, on)",
        ALL,
    ),
    FieldRule(
        "json_leading_whitespace",
        CORRAL,
        H,
        "false: a JSON answer starts at its first bracket or quote; true: one space or newline may come first, as "
        "the model writes it (default: the server's `--json-leading-whitespace`, off)",
        ALL,
    ),
    FieldRule(
        "json_whitespace",
        CORRAL,
        H,
        "`fixed`: a JSON answer is one line, `\", \"` and `\": \"` its only whitespace; `free`: the model's own "
        "layout, each gap between two tokens bounded (a space, or one or two newlines and an indent of up to 20; on "
        "xgrammar any 22 whitespace characters) (default: the server's `--json-whitespace`, fixed)",
        ALL,
    ),
    FieldRule(
        "drafts",
        CORRAL,
        H,
        "`false`: this request never feeds drafts (speculative decoding, docs/speculation.md); its answer is the "
        "same either way, only its speed differs (default: true, as the server's `--draft-tokens` allows)",
        ALL,
    ),
)

# Content part types of a chat message corral can read; the model is text-only.
TEXT_PART_TYPES = frozenset({"text"})
# Keys of a chat message corral reads (a null value of any other key is harmless: it says nothing).
MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})


def rules_for(endpoint: Endpoint) -> dict[str, FieldRule]:
    return {rule.name: rule for rule in FIELDS if endpoint in rule.endpoints}


_RULES = {endpoint: rules_for(endpoint) for endpoint in Endpoint}


def declared_fields(endpoint: Endpoint) -> set[str]:
    """Top-level fields the request model must declare: those honoured or mapped."""
    return {n for n, r in _RULES[endpoint].items() if "." not in n and r.treatment in (H, M)}


def screen(data: Any, endpoint: Endpoint) -> Any:
    """Refuse what corral does not implement; drop what it ignores. Runs before the model validates."""
    if not isinstance(data, dict):
        return data
    rules = _RULES[endpoint]
    kept: dict[str, Any] = {}
    for name, value in data.items():
        if _keep(name, value, rules):
            kept[name] = _screen_object(name, value, rules)
    if endpoint is Endpoint.CHAT:
        check_content_parts(kept.get("messages"))
    return kept


def _screen_object(parent: str, value: Any, rules: Mapping[str, FieldRule]) -> Any:
    prefix = parent + "."
    if not isinstance(value, dict) or not any(name.startswith(prefix) for name in rules):
        return value
    return {key: item for key, item in value.items() if _keep(prefix + str(key), item, rules)}


def _keep(name: str, value: Any, rules: Mapping[str, FieldRule]) -> bool:
    rule = rules.get(name)
    if rule is None:
        other = next((r for r in FIELDS if r.name == name), None)
        where = f"; it applies to {'/'.join(sorted(other.endpoints))} requests" if other else ""
        raise bad_request(
            f"unknown field {name!r}: corral does not implement it{where} (docs/api.md lists every field)",
            param=name,
            code="unknown_parameter",
        )
    if rule.treatment is Treatment.IGNORED:
        return False
    if rule.treatment is Treatment.REFUSED:
        if value is None or any(_same(value, n) for n in rule.neutral):
            return False  # what corral does anyway
        raise bad_request(
            f"{name}: corral does not implement this field ({rule.note})", param=name, code="unsupported_parameter"
        )
    return True


def _same(value: Any, neutral: Any) -> bool:
    # JSON `true` is not the number 1 here, nor 0 `false`.
    return isinstance(value, bool) == isinstance(neutral, bool) and type(value) in (type(neutral), int, float) and (
        value == neutral
    )


def check_content_parts(messages: Any) -> None:
    """A message field or content part corral cannot use is a 400, never silently dropped."""
    if not isinstance(messages, list):
        return
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            continue
        refuse_unknown_keys(message, MESSAGE_FIELDS, f"messages[{i}]", "message field")
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            part_text(part, f"messages[{i}].content[{j}]", TEXT_PART_TYPES)


def refuse_unknown_keys(obj: Mapping[str, Any], known: frozenset[str], param: str, what: str) -> None:
    """A key of `obj` corral does not read, with a value that says something, is a 400 naming it."""
    for key, value in obj.items():
        if key not in known and value is not None:
            raise bad_request(
                f"{param}.{key}: corral does not implement this {what}",
                param=f"{param}.{key}",
                code="unsupported_parameter",
            )


def part_text(part: Any, param: str, types: frozenset[str]) -> str:
    """A content part's text; a part of another type is a 400 naming it (the model reads text only)."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in types:
        raise bad_request(
            f"{param}: corral does not implement {kind!r} content parts; this model reads text only",
            param=param,
            code="unsupported_content",
        )
    text = part.get("text")
    if not isinstance(text, str):
        raise bad_request(f"{param}.text must be a string", param=f"{param}.text")
    return text


ENDPOINT_LABELS = {ALL: "all", BOTH: "chat, completions", CHAT_RESPONSES: "chat, responses"}


def markdown_table() -> str:
    """The table docs/api.md carries (one row per field and endpoint set)."""
    rows = ["| field | from | endpoints | corral | notes |", "|---|---|---|---|---|"]
    for rule in FIELDS:
        endpoints = ENDPOINT_LABELS.get(rule.endpoints) or next(iter(rule.endpoints)).value
        note = rule.note
        if rule.neutral:
            values = ", ".join(_json(v) for v in rule.neutral)
            note += f" (accepted when {values}, or null)"
        rows.append(f"| `{rule.name}` | {rule.origin} | {endpoints} | {rule.treatment} | {note} |")
    return "\n".join(rows) + "\n"


def _json(value: Any) -> str:
    import json

    return f"`{json.dumps(value)}`"


def max_tokens_for(max_completion_tokens: int | None, max_tokens: int | None, *, room: int, default: int) -> int:
    """The generation budget. A budget the caller gave that the context cannot hold is a 400 (as OpenAI
    answers), never silently shortened; only the server's default is clamped to what the prompt leaves."""
    requested, param = (max_completion_tokens, "max_completion_tokens") if max_completion_tokens else (
        max_tokens, "max_tokens"
    )
    if requested is None:
        return min(default, room)
    if requested > room:
        raise bad_request(
            f"{param} is {requested}, but the prompt leaves room for {room} tokens in this model's context; "
            f"ask for at most {room}",
            param=param,
            code="context_length_exceeded",
        )
    return requested


if __name__ == "__main__":  # regenerate the table in docs/api.md
    print(markdown_table(), end="")
