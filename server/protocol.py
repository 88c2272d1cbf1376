"""OpenAI request/response shapes (with vLLM's names where OpenAI has none)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    # Unknown fields are ignored like OpenAI's API does; known ones are type-checked.
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
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
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    ignore_eos: bool = False
    max_revisions: int | None = Field(None, ge=0, description="per-request revision depth limit")
    user: str | None = None

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

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(str(part.get("text", "")) for part in self.content if part.get("type") == "text")


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(..., min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class CompletionRequest(_Request):
    prompt: str | list[str] = Field(...)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)

    def prompt_text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise ValueError("prompt: corral takes one prompt per request")
        return self.prompt[0]


def error_body(
    message: str, *, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
