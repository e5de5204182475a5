"""OpenAI's Responses API request body, and the chat request it amounts to.

A Responses request is a chat request in other words: its input items become chat messages
(function calls an assistant turn's tool calls, their outputs tool turns), its function tools
and ``text.format`` the chat's tools and ``response_format``. Generation then takes the chat
path unchanged.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

from heron.server.protocol import ChatCompletionRequest, NullIsUnset, UnsupportedFieldError

# Fields about storage, billing and identity: accepted, as they do not change the output.
_NO_EFFECT_FIELDS = frozenset({"user", "service_tier", "prompt_cache_key", "safety_identifier"})


class TextPart(BaseModel):
    """A message's text part; a past assistant turn's parts are ``output_text``."""

    type: Literal["input_text", "output_text"]
    text: str


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


class MessageItem(BaseModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text"):
                raise ValueError(
                    f"content parts of type {kind!r} are not supported (text parts only)"
                )
        return content


class FunctionCallItem(BaseModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(BaseModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]


class ReasoningItem(BaseModel):
    """A past turn's reasoning, sent back by clients that keep the whole output. It is not
    shown to the model again: chat templates of reasoning models drop past reasoning."""

    type: Literal["reasoning"]


def _item_kind(item: Any) -> str:
    """An item's ``type``; a message may leave it out."""
    return (item.get("type") if isinstance(item, dict) else None) or "message"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind),
]


class FunctionTool(BaseModel):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(BaseModel):
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_named(self) -> TextFormat:
        if self.type == "json_schema" and (self.schema_ is None or self.name is None):
            raise ValueError("a format of type json_schema needs a name and a schema")
        return self


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: TextFormat | None = None


class ResponsesChatRequest(ChatCompletionRequest):
    """The chat request a Responses request amounts to; its errors name the Responses field."""

    @property
    def max_tokens_field(self) -> str:
        return "max_output_tokens"


class ResponsesRequest(NullIsUnset):
    """``POST /v1/responses``. Unknown fields are kept so that :meth:`check_supported` refuses
    them by name; an explicit null is a field not given."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: Annotated[str, Field(min_length=1)] | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    # Declared to be refused with a reason when set (see check_supported).
    background: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, tools: Any) -> Any:
        for tool in tools if isinstance(tools, list) else ():
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(
                    f"tools of type {kind!r} are not supported (built-in tools run on OpenAI's "
                    "side; this server takes function tools)"
                )
        return tools

    def check_supported(self) -> None:
        """Raise :class:`UnsupportedFieldError` for the first field Heron cannot honour."""
        for name in self.model_extra or {}:
            if name not in _NO_EFFECT_FIELDS:
                raise UnsupportedFieldError(name)
        refused = {
            "background": self.background,
            "truncation": self.truncation == "auto",
            "include": self.include,
            "reasoning": self.reasoning,
        }
        for name, value in refused.items():
            if value:
                raise UnsupportedFieldError(name)

    def messages(self) -> list[dict[str, Any]]:
        """The input as chat messages: function calls join the assistant turn they follow."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages: list[dict[str, Any]] = []
        for item in self.input:
            if isinstance(item, MessageItem):
                role = "system" if item.role == "developer" else item.role
                messages.append({"role": role, "content": _text(item.content)})
            elif isinstance(item, FunctionCallItem):
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
                last = messages[-1] if messages else None
                if last is None or last["role"] != "assistant":
                    last = {"role": "assistant", "content": ""}
                    messages.append(last)
                last.setdefault("tool_calls", []).append(call)
            elif isinstance(item, FunctionCallOutputItem):
                messages.append(
                    {"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)}
                )
        if not messages:
            raise ValueError("input has reasoning items only: there is nothing to answer")
        return messages

    def chat_request(self, history: list[dict[str, Any]]) -> ResponsesChatRequest:
        """The chat request of this input after ``history`` (the earlier turns, when the
        request continues a stored response), under this request's instructions."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        fields: dict[str, Any] = {
            "model": self.model,
            "messages": [*system, *history, *self.messages()],
            "stream": self.stream,
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "parallel_tool_calls": self.parallel_tool_calls,
        }
        if self.tools:
            fields["tools"] = [
                {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                for t in self.tools
            ]
        if isinstance(self.tool_choice, FunctionToolChoice):
            fields["tool_choice"] = {
                "type": "function",
                "function": {"name": self.tool_choice.name},
            }
        elif self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema":
            schema = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}
            fields["response_format"] = {"type": "json_schema", "json_schema": schema}
        elif fmt is not None:
            fields["response_format"] = {"type": fmt.type}
        return ResponsesChatRequest.model_validate(
            {k: v for k, v in fields.items() if v is not None}
        )
