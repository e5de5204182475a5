"""OpenAI API request and response bodies (pydantic), plus vLLM's extra sampling fields."""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, Field, model_serializer

from heron.sampling_params import SamplingParams
from heron.server.structured_protocol import (
    ChatTool,
    DeltaToolCall,
    StructuredRequestFields,
    ToolCall,
    ToolChoice,
)
from heron.server.tool_parsers import forced_tool_schema
from heron.structured import StructuredOutputsParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingRequest(StructuredRequestFields):
    """Fields shared by completions and chat completions; unknown fields are ignored."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    # Extras beyond the OpenAI schema, named as in vLLM.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def _sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """Build validated params; ``SamplingParams`` raises ``ValueError`` naming a bad field."""
        defaults = SamplingParams()

        def pick(value: Any, default: Any) -> Any:
            return default if value is None else value

        return SamplingParams(
            n=self.n,
            temperature=pick(self.temperature, defaults.temperature),
            top_p=pick(self.top_p, defaults.top_p),
            top_k=pick(self.top_k, defaults.top_k),
            min_p=pick(self.min_p, defaults.min_p),
            repetition_penalty=pick(self.repetition_penalty, defaults.repetition_penalty),
            presence_penalty=pick(self.presence_penalty, defaults.presence_penalty),
            frequency_penalty=pick(self.frequency_penalty, defaults.frequency_penalty),
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=structured_outputs or self.structured_outputs_params(),
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    def sampling_params(self) -> SamplingParams:
        return self._sampling_params(self.max_tokens, self.logprobs)


class ChatMessage(BaseModel):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers

    def text(self) -> str:
        """The content as one string (text parts of a multi-part message joined)."""
        if isinstance(self.content, list):
            return "".join(part.get("text", "") for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True

    @property
    def effective_tool_choice(self) -> ToolChoice:
        """OpenAI's default: ``auto`` when tools are given, else ``none``."""
        return self.tool_choice or ("auto" if self.tools else "none")

    def conversation(self) -> list[dict[str, Any]]:
        conv = []
        for m in self.messages:
            message = {"role": m.role, "content": m.text()}
            if m.name is not None:
                message["name"] = m.name
            if m.tool_calls:
                message["tool_calls"] = [_template_call(c) for c in m.tool_calls]
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            conv.append(message)
        return conv

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates take them (``tools=``)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def sampling_params(self) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        schema = None
        if self.tools and self.effective_tool_choice not in ("auto", "none"):
            if self.structured_outputs_params() is not None:
                raise ValueError("structured_outputs cannot be combined with a forced tool_choice")
            schema = forced_tool_schema(
                self.tools, self.effective_tool_choice, self.parallel_tool_calls
            )
        forced = None if schema is None else StructuredOutputsParams(json=schema)
        # OpenAI's default is "until the context ends"; max_completion_tokens supersedes.
        return self._sampling_params(
            self.max_completion_tokens or self.max_tokens, logprobs, forced
        )


def _template_call(call: ToolCall) -> dict[str, Any]:
    """A past tool call for the chat template, its arguments as an object (what templates
    such as Qwen's and Llama's expect) when they are JSON."""
    data = call.model_dump()
    try:
        data["function"]["arguments"] = json.loads(call.function.arguments)
    except ValueError:
        pass
    return data


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: Any) -> dict[str, Any]:
        # OpenAI deltas carry only what changed: no "role": null after the first chunk.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "heron"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
