"""Request and response bodies of structured outputs and tool calls (OpenAI's and vLLM's names).

A request constrains its output in one of three ways: OpenAI's ``response_format``, vLLM's
``structured_outputs`` object, or vLLM's older ``guided_*`` fields. Giving two is refused.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from heron.structured import StructuredOutputsParams


class JsonSchemaFormat(BaseModel):
    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    # The grammar always keeps to the schema (and allows no other properties), which is what
    # strict asks for; a non-strict request gets the same outputs, all of which are valid.
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(BaseModel):
    """vLLM's ``structured_outputs`` object; fields it has that Heron does not are refused."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class StructuredRequestFields(BaseModel):
    """The request fields that constrain the output, and the params they amount to."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one constraint the request gives; ``ValueError`` if it gives several."""
        given: dict[str, StructuredOutputsParams] = {}
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            given["response_format"] = StructuredOutputsParams(json_object=True)
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise ValueError("response_format of type json_schema needs json_schema")
            given["response_format"] = StructuredOutputsParams(json=fmt.json_schema.schema_)
        if self.structured_outputs is not None:
            so = self.structured_outputs
            given["structured_outputs"] = StructuredOutputsParams(
                json=so.json_,
                json_object=bool(so.json_object),
                regex=so.regex,
                choice=so.choice,
                grammar=so.grammar,
            )
        guided = {
            "json": self.guided_json,
            "regex": self.guided_regex,
            "choice": self.guided_choice,
            "grammar": self.guided_grammar,
        }
        for kind, value in guided.items():
            if value is not None:
                given[f"guided_{kind}"] = StructuredOutputsParams(**{kind: value})
        if len(given) > 1:
            raise ValueError(f"structured_outputs: give only one of {', '.join(given)}")
        return next(iter(given.values()), None)


# ---------------------------------------------------------------- tools


class FunctionDefinition(BaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A piece of a tool call in a stream, as OpenAI sends it: the first has the id, type and
    name, the next ones fragments of the arguments; what is not sent is left out."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        data["function"] = {k: v for k, v in data["function"].items() if v is not None}
        return {k: v for k, v in data.items() if v is not None}
