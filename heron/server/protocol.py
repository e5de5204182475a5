"""OpenAI API request and response bodies (pydantic), plus vLLM's extra sampling fields."""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

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

# A token id as JSON gives it: an integer (neither a bool nor a float) that the engine's int64
# tensors can hold; the vocabulary is checked later.
TokenId = Annotated[int, Strict(), Field(ge=0, le=2**63 - 1)]
# A count of new tokens, when given.
PositiveInt = Annotated[int, Field(ge=1)]


class NullIsUnset(BaseModel):
    """A request body in which an explicit ``null`` means "not given": OpenAI's schema makes
    its fields nullable, and clients other than the official SDK send nulls. A field whose own
    type takes None keeps it (``max_tokens: null``: no limit)."""

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if v is not None or _takes_none(cls, k)}


def _takes_none(model: type[BaseModel], name: str) -> bool:
    field = model.model_fields.get(name)
    return field is not None and type(None) in get_args(field.annotation)


class StreamOptions(NullIsUnset):
    include_usage: bool = False


class UnsupportedFieldError(ValueError):
    """A request field that would change the result and that Heron does not implement."""

    def __init__(self, name: str, message: str | None = None) -> None:
        super().__init__(message or f"{name} is not supported by this server")
        self.name = name


class _SamplingRequest(StructuredRequestFields, NullIsUnset):
    """Fields shared by completions and chat completions.

    Unknown fields are kept (``extra="allow"``) so that :meth:`check_supported` can reject
    them by name: a field that changes the result must never be ignored silently.
    """

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    # OpenAI's fields about storage, billing and identity: accepted, as they do not change
    # the output, but typed.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    n: int = 1
    best_of: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[int, float] | None = None  # JSON keys are token ids as strings
    # Extras beyond the OpenAI schema, named as in vLLM.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None  # top-N per prompt token, returned apart from `logprobs`
    # Prefill/decode disaggregation (a KV connector's), as vLLM's.
    kv_transfer_params: dict[str, Any] | None = None

    def check_supported(self) -> None:
        """Raise :class:`UnsupportedFieldError` for the first field Heron cannot honour, a
        ``ValueError`` naming a field that contradicts another."""
        for name in self.model_extra or {}:
            raise UnsupportedFieldError(name)
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options needs stream=true")
        if self.best_of is not None and self.best_of != self.n:
            raise UnsupportedFieldError(
                "best_of", f"best_of must equal n ({self.n}): every sample is returned"
            )
        if self.stream and self.prompt_logprobs is not None:
            raise UnsupportedFieldError(
                "prompt_logprobs", "prompt_logprobs are not available when streaming (as vLLM)"
            )

    def _sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
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
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias=self.logit_bias,
            structured_outputs=structured_outputs or self.structured_outputs_params(),
            kv_transfer_params=self.kv_transfer_params,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    max_tokens_field: ClassVar[str] = "max_tokens"  # the field requested_max_tokens reads

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt: Any) -> Any:
        if not prompt:
            raise ValueError("the prompt is empty")
        return prompt

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def check_supported(self) -> None:
        super().check_supported()
        if self.kv_transfer_params is not None and len(self.prompts()) > 1:
            raise ValueError("kv_transfer_params: a request that carries them has one prompt")

    def sampling_params(self) -> SamplingParams:
        # Echoed prompt tokens carry their logprobs too, as in OpenAI's API.
        wanted = [self.prompt_logprobs, self.logprobs if self.echo else None]
        prompt_logprobs = max((n for n in wanted if n is not None), default=None)
        return self._sampling_params(self.max_tokens, self.logprobs, prompt_logprobs)


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers

    @field_validator("content")
    @classmethod
    def _text_and_image_parts_only(cls, content: Any) -> Any:
        for part in content if isinstance(content, list) else ():
            kind = part.get("type")
            if kind == "image_url":
                url = part.get("image_url")
                if not isinstance(url, dict) or not isinstance(url.get("url"), str):
                    raise ValueError("an image_url part needs image_url: {'url': ...}")
            elif kind != "text" or not isinstance(part.get("text"), str):
                raise ValueError(
                    f"content parts of type {kind!r} are not supported "
                    "(this server takes text and image_url parts)"
                )
        return content

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> ChatMessage:
        # (an assistant turn that called tools may have none)
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        """The content as one string (the text parts of a multi-part message joined)."""
        if isinstance(self.content, list):
            return "".join(part.get("text", "") for part in self.content)
        return self.content or ""

    @property
    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(
            part.get("type") == "image_url" for part in self.content
        )


def _conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as a chat template takes them (a message with images keeps its parts,
    for :func:`heron.multimodal.chat.take_images`)."""
    conv = []
    for m in messages:
        message = {"role": m.role, "content": m.content if m.has_images else m.text()}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_calls:
            message["tool_calls"] = [_template_call(c) for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        conv.append(message)
    return conv


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None  # a Jinja template instead of the tokenizer's, as vLLM
    chat_template_kwargs: dict[str, Any] | None = None  # more variables of the template
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, top_logprobs: int | None, info: ValidationInfo) -> int | None:
        if top_logprobs is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs=true")
        return top_logprobs

    @property
    def effective_tool_choice(self) -> ToolChoice:
        """OpenAI's default: ``auto`` when tools are given, else ``none``."""
        return self.tool_choice or ("auto" if self.tools else "none")

    def conversation(self) -> list[dict[str, Any]]:
        return _conversation(self.messages)

    @property
    def max_tokens_field(self) -> str:
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"

    @property
    def requested_max_tokens(self) -> int | None:
        # OpenAI's default is "until the context ends"; max_completion_tokens supersedes.
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

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
        return self._sampling_params(
            self.requested_max_tokens, logprobs, self.prompt_logprobs, forced
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


class PromptLogprob(BaseModel):
    """vLLM's entry of a prompt token's logprobs."""

    logprob: float
    rank: int
    decoded_token: str


# Per prompt token (the first None): token id (as a JSON key) -> its logprob, as vLLM returns.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    kv_transfer_params: dict[str, Any] | None = None  # what a decode instance needs


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
    prompt_logprobs: PromptLogprobs | None = None
    kv_transfer_params: dict[str, Any] | None = None  # what a decode instance needs


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
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class LoadLoRAAdapterRequest(NullIsUnset):
    lora_name: str
    lora_path: str  # a PEFT adapter directory or a Hub id


class UnloadLoRAAdapterRequest(NullIsUnset):
    lora_name: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(NullIsUnset):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def conversation(self) -> list[dict[str, Any]]:
        return _conversation(self.messages or [])


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(NullIsUnset):
    model: str | None = None
    tokens: list[int]  # checked against the vocabulary


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
