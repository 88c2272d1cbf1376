"""OpenAI requests in the serving core's terms: a prompt's token ids, a constraint and sampling parameters.

The chat path parses `tools` once and uses it twice: to render the prompt and to build the tool-call
constraint. Everything whose cost grows with the request runs on the service's prepare threads.
"""

from __future__ import annotations

from typing import Any

from corral.grammars.request import ConstraintRequest, parse_constraint
from corral.grammars.validation import InvalidConstraint
from corral.server.engine import SamplingParams
from corral.server.errors import bad_request
from corral.server.openai.chat_render import MessageError, prompt_ids
from corral.server.openai.fields import max_tokens_for
from corral.server.openai.logprobs import requested_logprobs
from corral.server.openai.protocol import ChatCompletionRequest, CompletionRequest, ConstraintFields, _Request
from corral.server.openai.tools import ToolRequest, detect_format, parse_tools, tool_constraint
from corral.server.prepared import Admission, Prepared, check_prompt_fits
from corral.server.serving import Service
from corral.server.settings import Settings


class OpenAIFrontend:
    """Reads OpenAI requests for one `Service`: each request is one `prepare` call, its reading (whose cost grows
    with the request) handed over to run on the service's prepare threads."""

    def __init__(self, service: Service, settings: Settings) -> None:
        self.service = service
        self.settings = settings
        self.limits = settings.input_limits()  # request limits on constraints (corral/grammars/limits.py)
        self.tool_format = detect_format(settings.tool_call_format, service.tokenizer)

    async def prepare_chat(self, req: ChatCompletionRequest) -> Prepared:
        def build() -> Admission:
            tools, prompt = self.chat_prompt(req)
            return self._admission(req, prompt, tools, prompt_param="messages")

        return await self.service.prepare(req.model, build, stream=bool(req.stream))

    async def prepare_completion(self, req: CompletionRequest) -> Prepared:
        def build() -> Admission:
            return self._admission(req, self.completion_prompt(req), None, prompt_param="prompt")

        return await self.service.prepare(req.model, build, stream=bool(req.stream))

    def chat_prompt(self, req: ChatCompletionRequest) -> tuple[ToolRequest | None, list[int]]:
        """The request's tools, and its messages (with tools, calls and results) as the chat template renders them."""
        tools = self.tools(req.tools, req.tool_choice, req.parallel_tool_calls)
        try:
            return tools, prompt_ids(self.service.tokenizer, req.messages, tools, self.tool_format)
        except MessageError as exc:
            raise bad_request(str(exc), param=exc.param) from exc

    def tools(self, tools: list[dict[str, Any]] | None, choice: Any, parallel: bool) -> ToolRequest | None:
        try:
            return parse_tools(tools, choice, parallel, limits=self.limits)
        except InvalidConstraint as exc:
            raise bad_request(str(exc), param=exc.param, code=exc.code) from exc

    def completion_prompt(self, req: CompletionRequest) -> list[int]:
        try:
            text = req.prompt_text()
        except ValueError as exc:
            raise bad_request(str(exc), param="prompt") from exc
        ids = [int(t) for t in self.service.tokenizer.encode(text, add_special_tokens=True)]
        if not ids:  # a tokenizer without BOS gives "" no token, and the engine needs one to start from
            raise bad_request("prompt is empty: give at least one token of text", param="prompt")
        return ids

    def constraint(self, fields: ConstraintFields, tools: ToolRequest | None) -> ConstraintRequest:
        """The request's constraint: response_format, structured_outputs or a guided_* field, then its tools."""
        legacy = fields.legacy_constraint()
        try:
            constraint = parse_constraint(fields.response_format, fields.structured_outputs, legacy, limits=self.limits)
            constraint = tool_constraint(tools, constraint, self.tool_format)
        except InvalidConstraint as exc:
            raise bad_request(str(exc), param=exc.param, code=exc.code) from exc
        return constraint

    def _admission(
        self, req: _Request, prompt: list[int], tools: ToolRequest | None, *, prompt_param: str
    ) -> Admission:
        """The prompt checked against the context, the constraint (schema checks) and sampling parameters."""
        check_prompt_fits(len(prompt), self.service.max_len, param=prompt_param)
        return Admission(prompt, self.constraint(req, tools), self.sampling_params(req, len(prompt)))

    def sampling_params(self, req: _Request, prompt_len: int) -> SamplingParams:
        room = self.service.max_len - prompt_len
        max_tokens = max_tokens_for(
            req.max_completion_tokens, req.max_tokens, room=room, default=self.settings.default_max_tokens
        )
        logprobs, top_logprobs = requested_logprobs(req)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
            seed=req.seed,
            stop=req.stop_list(),
            logit_bias=self._logit_bias(req.logit_bias),
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            ignore_eos=req.ignore_eos,
            max_revisions=req.max_revisions,
            close_answers=req.close_answers,
            json_leading_whitespace=req.json_leading_whitespace,
            json_whitespace=req.json_whitespace,
            drafts=req.drafts,
        )

    def _logit_bias(self, given: dict[str, float] | None) -> dict[int, float]:
        vocab = self.service.vocab_size
        bias: dict[int, float] = {}
        for key, value in (given or {}).items():
            try:
                token = int(key)
            except ValueError as exc:
                raise bad_request(f"logit_bias key {key!r} is not a token id", param="logit_bias") from exc
            if not 0 <= token < vocab or not -100 <= value <= 100:
                message = f"logit_bias {key}: token ids are 0..{vocab - 1}, biases -100..100"
                raise bad_request(message, param="logit_bias")
            bias[token] = float(value)
        return bias
