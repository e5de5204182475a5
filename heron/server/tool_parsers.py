"""Tool calls in generated text: the parsers of ``--tool-call-parser`` and forced tool choices.

Every parser reads the text as it streams (``feed``) and at the end (``finish``); a response
that is not streamed is one ``feed`` of the whole text. Text that is not a call passes through
as content as soon as it cannot start one; a call goes out whole once its text is complete.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from heron.server.partial_tags import partial_tag_length
from heron.server.structured_protocol import ChatTool, FunctionCall, NamedToolChoice, ToolCall

ParsedText = tuple[str, list[ToolCall]]  # content, and the tool calls completed with it


def _call(name: Any, arguments: Any) -> ToolCall | None:
    """A tool call from parsed JSON, or None if it does not have a call's shape."""
    if not isinstance(name, str) or not isinstance(arguments, dict | str):
        return None
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(
        id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(name=name, arguments=text)
    )


class HermesToolParser:
    """Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, repeated."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._buffer = ""
        self._in_call = False

    def feed(self, text: str) -> ParsedText:
        self._buffer += text
        content, calls = [], []
        while True:
            if self._in_call:
                end = self._buffer.find(self.CLOSE)
                if end < 0:
                    return "".join(content), calls
                body = self._buffer[:end]
                self._buffer = self._buffer[end + len(self.CLOSE) :]
                self._in_call = False
                call = self._parse(body)
                if call is None:
                    content.append(self.OPEN + body + self.CLOSE)
                else:
                    calls.append(call)
                continue
            start = self._buffer.find(self.OPEN)
            if start < 0:
                keep = partial_tag_length(self._buffer, self.OPEN)
                content.append(self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep :]
                return "".join(content), calls
            content.append(self._buffer[:start])
            self._buffer = self._buffer[start + len(self.OPEN) :]
            self._in_call = True

    def finish(self) -> ParsedText:
        """What is left: an unclosed call still counts if its JSON is complete."""
        rest, self._buffer = self._buffer, ""
        if self._in_call:
            self._in_call = False
            call = self._parse(rest)
            return ("", [call]) if call is not None else (self.OPEN + rest, [])
        return rest, []

    @staticmethod
    def _parse(body: str) -> ToolCall | None:
        try:
            data = json.loads(body)
        except ValueError:
            return None
        if not isinstance(data, dict):
            return None
        return _call(data.get("name"), data.get("arguments", {}))


class Llama3JsonToolParser:
    """Llama 3: the whole reply is ``{"name": ..., "parameters": {...}}`` (``;``-separated for
    several calls, optionally after ``<|python_tag|>``); any other reply is content."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        self._buffer = ""
        self._is_call: bool | None = None  # undecided until the first visible character

    def feed(self, text: str) -> ParsedText:
        if self._is_call is False:
            return text, []
        self._buffer += text
        start = self._buffer.lstrip()
        if not start or (len(start) < len(self.TAG) and self.TAG.startswith(start)):
            return "", []
        self._is_call = start.startswith(("{", self.TAG))
        if self._is_call:
            return "", []
        rest, self._buffer = self._buffer, ""
        return rest, []

    def finish(self) -> ParsedText:
        rest, self._buffer = self._buffer, ""
        if not self._is_call:
            return rest, []
        calls = []
        decoder = json.JSONDecoder()
        body, position = rest.strip().removeprefix(self.TAG).strip(), 0
        while position < len(body):
            try:
                data, position = decoder.raw_decode(body, position)
            except ValueError:
                return rest, []
            if not isinstance(data, dict):
                return rest, []
            call = _call(data.get("name"), data.get("parameters", data.get("arguments")))
            if call is None:
                return rest, []
            calls.append(call)
            position = _skip(body, position, " \n;")
        return "", calls


def _skip(text: str, position: int, characters: str) -> int:
    while position < len(text) and text[position] in characters:
        position += 1
    return position


class ForcedToolParser:
    """``tool_choice="required"`` (a JSON array of ``{"name", "parameters"}``) or a named
    function (a JSON object, its arguments): the grammar made the text, so it is all calls."""

    def __init__(self, function_name: str | None) -> None:
        self._function_name = function_name
        self._buffer = ""

    def feed(self, text: str) -> ParsedText:
        self._buffer += text
        return "", []

    def finish(self) -> ParsedText:
        rest, self._buffer = self._buffer, ""
        try:
            data = json.loads(rest)
        except ValueError:
            return rest, []  # cut short (max_tokens): the text as it is
        if self._function_name is not None:
            call = _call(self._function_name, data)
            return ("", [call]) if call is not None else (rest, [])
        items = data if isinstance(data, list) else []
        calls = [_call(i.get("name"), i.get("parameters")) for i in items if isinstance(i, dict)]
        return ("", calls) if calls and len(calls) == len(items) and all(calls) else (rest, [])


TOOL_PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}


def forced_tool_schema(
    tools: list[ChatTool], choice: str | NamedToolChoice, parallel: bool
) -> dict[str, Any] | None:
    """The JSON schema that makes ``required`` or a named choice a tool call (None otherwise);
    ``ValueError`` if the named function is not among the tools."""
    parameters = {
        t.function.name: t.function.parameters or {"type": "object", "properties": {}}
        for t in tools
    }
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in parameters:
            raise ValueError(f"tool_choice names the function {name!r}, which is not in tools")
        return parameters[name]
    if choice != "required":
        return None
    calls = [
        {
            "type": "object",
            "properties": {"name": {"enum": [name]}, "parameters": schema},
            "required": ["name", "parameters"],
        }
        for name, schema in parameters.items()
    ]
    array = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel:
        array["maxItems"] = 1
    return array
