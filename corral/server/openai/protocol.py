"""OpenAI request/response shapes (with vLLM's names where OpenAI has none)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from corral.grammars.spec import JsonWhitespace
from corral.server.errors import error_body as error_body  # the error shape lives in corral/server/errors.py
from corral.server.openai.fields import Endpoint, screen


class ConstraintFields(BaseModel):
    """The fields that carry a constraint: OpenAI's response_format, vLLM's structured_outputs, and vLLM's older
    guided_* names, mapped onto structured_outputs (corral/grammars/request.py)."""

    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_json_object: Any = None
    guided_choice: Any = None
    guided_regex: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None

    def legacy_constraint(self) -> dict[str, Any]:
        """The guided_* fields the request carries, by name."""
        return {name: getattr(self, name) for name in LEGACY_FIELDS if getattr(self, name) is not None}


class _Request(ConstraintFields):
    # Every field is listed in corral/server/openai/fields.py; `screen` refuses or drops what is not declared here.
    model_config = ConfigDict(extra="forbid")
    ENDPOINT: ClassVar[Endpoint]

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # OpenAI's range (int64); torch takes it all
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=16)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    top_k: int = Field(-1, ge=-1)  # vLLM: -1 or 0 = off
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    max_revisions: int | None = Field(None, ge=0, description="per-request revision depth limit")
    close_answers: bool | None = Field(None, description="close a structured answer the budget would cut")
    json_leading_whitespace: bool | None = Field(
        None, description="allow one space or newline before a JSON answer (default: the server's setting)"
    )
    json_whitespace: JsonWhitespace | None = Field(
        None, description="fixed: a one-line JSON answer; free: the model's own layout (default: the server's setting)"
    )
    drafts: bool = Field(True, description="false: no speculative decoding for this request")

    @model_validator(mode="before")
    @classmethod
    def _screen(cls, data: Any) -> Any:
        return screen(data, cls.ENDPOINT)

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        items = [self.stop] if isinstance(self.stop, str) else self.stop
        return tuple(s for s in items if s)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(str(part.get("text", "")) for part in self.content if part.get("type") == "text")


class ChatCompletionRequest(_Request):
    ENDPOINT = Endpoint.CHAT
    messages: list[ChatMessage] = Field(..., min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True


class CompletionRequest(_Request):
    ENDPOINT = Endpoint.COMPLETIONS
    prompt: str | list[str] = Field(...)
    logprobs: int | None = Field(None, ge=0, le=5)

    def prompt_text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise ValueError("prompt: corral takes one prompt per request")
        return self.prompt[0]


LEGACY_FIELDS = (
    "guided_json",
    "guided_json_object",
    "guided_choice",
    "guided_regex",
    "guided_grammar",
    "guided_decoding_backend",
)
