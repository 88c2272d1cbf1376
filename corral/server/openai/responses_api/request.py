"""The Responses API request body. Its fields are listed with chat's in corral/server/openai/fields.py (endpoint
`responses`); what corral does not implement is refused there, before this model validates."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from corral.grammars.spec import JsonWhitespace
from corral.server.openai.fields import Endpoint, screen

LOGPROBS_INCLUDE = "message.output_text.logprobs"


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ENDPOINT: ClassVar[Endpoint] = Endpoint.RESPONSES

    model: str | None = None
    input: str | list[Any] = Field(...)
    instructions: str | None = None
    text: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(None, ge=1)
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stream: bool = False
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    structured_outputs: dict[str, Any] | None = None
    max_revisions: int | None = Field(None, ge=0)
    close_answers: bool | None = None
    json_leading_whitespace: bool | None = None
    json_whitespace: JsonWhitespace | None = None
    drafts: bool = True

    @model_validator(mode="before")
    @classmethod
    def _screen(cls, data: Any) -> Any:
        return screen(data, cls.ENDPOINT)

    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ()) or bool(self.top_logprobs)

    def text_format(self) -> dict[str, Any] | None:
        """`text.format`, or None when absent (plain text)."""
        fmt = (self.text or {}).get("format")
        return fmt if isinstance(fmt, dict) else None
