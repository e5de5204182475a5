"""Tool calls in generated text: the parsers of ``--tool-call-parser`` and forced tool choices.

Every parser reads the text as it streams (``feed``) and at the end (``finish``); a response
that is not streamed is one ``feed`` of the whole text. Text that is not a call passes through
as content as soon as it cannot start one. A call comes out as :class:`ToolCallDelta`s, as
OpenAI streams it: the first names the function as soon as its name is complete, the next ones
carry the arguments' JSON text as it arrives (:func:`join_tool_calls` makes whole calls).

A call must name one of the request's tools (one that does not stays text) and have arguments
that are a JSON object: a parser that sent a call which ends otherwise (cut short, or its JSON
broken) says so (``broken``), and the reply is then plain content, as vLLM's parsers fall back.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from heron.server.partial_tags import partial_tag_length
from heron.server.structured_protocol import ChatTool, FunctionCall, NamedToolChoice, ToolCall


@dataclass
class ToolCallDelta:
    """A piece of the reply's call number ``index``: its first piece has ``id`` and ``name``;
    the ``arguments`` of all its pieces, concatenated, are the call's JSON arguments."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


ParsedText = tuple[str, list[ToolCallDelta]]  # content, and the tool-call pieces with it


def join_tool_calls(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    """Whole calls from their pieces, in call order."""
    calls: dict[int, ToolCall] = {}
    for delta in deltas:
        call = calls.get(delta.index)
        if call is None:
            function = FunctionCall(name=delta.name or "", arguments="")
            call = calls[delta.index] = ToolCall(id=delta.id or "", function=function)
        call.function.arguments += delta.arguments
    return [calls[i] for i in sorted(calls)]


def _whole_call(index: int, name: Any, arguments: Any) -> ToolCallDelta | None:
    """A call in one piece from parsed JSON, or None if it does not have a call's shape."""
    if not isinstance(name, str) or not isinstance(arguments, dict | str):
        return None
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCallDelta(index, text, _call_id(), name)


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# A call object's text up to the opening brace of its arguments (an object).
_CALL_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)'
)


class _CallObject:
    """One ``{"name": ..., "arguments": {...}}`` object as its text streams in.

    Brackets are counted outside strings, so the end of the arguments and of the object are
    known as they arrive. Once the text up to the arguments' opening brace is in, the name goes
    out if it is one of ``names``, and then the arguments' text as it comes (``streaming``); an
    object whose keys come in another order is only parsed whole at its end.
    """

    def __init__(self, index: int, names: frozenset[str]) -> None:
        self.index, self.names = index, names
        self.text = ""
        self.end: int | None = None  # just past the object's closing brace, once seen
        self._arguments_start: int | None = None
        self._arguments_end: int | None = None
        self._sent: int | None = None  # arguments sent up to here; None: the name not yet
        self._depth, self._in_string, self._escaped = 0, False, False

    @property
    def streaming(self) -> bool:
        return self._sent is not None

    @property
    def complete(self) -> bool:
        """Whether a streamed call ended as a call: the object closed, its arguments an
        object."""
        if self.end is None or self._arguments_end is None:
            return False
        try:
            arguments = json.loads(self.text[self._arguments_start : self._arguments_end])
        except ValueError:
            return False
        return isinstance(arguments, dict)

    def feed(self, text: str) -> list[ToolCallDelta]:
        scanned = len(self.text)
        self.text += text
        if self.end is None:
            self._scan(scanned)
        deltas = []
        if self._sent is None:
            head = _CALL_HEAD.match(self.text) if self._arguments_start is None else None
            if head is None:
                return []
            self._arguments_start = head.end()
            name = json.loads(head[1])
            if name not in self.names:
                return []  # not a call: parsed whole at its end, where it is refused
            self._sent = head.end()
            deltas.append(ToolCallDelta(self.index, "", _call_id(), name))
        stop = len(self.text) if self._arguments_end is None else self._arguments_end
        if stop > self._sent:
            fragment, self._sent = self.text[self._sent : stop], stop
            if deltas:
                deltas[0].arguments = fragment
            else:
                deltas.append(ToolCallDelta(self.index, fragment))
        return deltas

    def _scan(self, position: int) -> None:
        for i in range(position, len(self.text)):
            char = self.text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 1 and self._arguments_end is None:
                    self._arguments_end = i + 1
                if self._depth <= 0:
                    self.end = i + 1
                    return

    def whole(self) -> ToolCallDelta | None:
        """The call parsed from the whole text, in one piece; None if it is not one."""
        try:
            data = json.loads(self.text)
        except ValueError:
            return None
        if not isinstance(data, dict) or data.get("name") not in self.names:
            return None
        arguments = data.get("arguments", data.get("parameters", {}))
        return _whole_call(self.index, data.get("name"), arguments)


class HermesToolParser:
    """Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, repeated.

    A call whose name and arguments stream is sent as it comes, and is ``broken`` if its JSON
    does not end as a call's; one that is not recognised so (other keys, an unknown name) is
    parsed at its closing tag, and stays content (the reply ``broken``) when it is not a call.
    """

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names
        self.broken = False
        self._buffer = ""
        self._call: _CallObject | None = None
        self._num_calls = 0

    def feed(self, text: str) -> ParsedText:
        self._buffer += text
        content, deltas = [], []
        while True:
            if self._call is not None:
                end = self._buffer.find(self.CLOSE)
                body_end = len(self._buffer) - partial_tag_length(self._buffer, self.CLOSE)
                body = self._buffer[: end if end >= 0 else body_end]
                self._buffer = self._buffer[len(body) :]
                deltas += self._call.feed(body)
                if end < 0:
                    return "".join(content), deltas
                self._buffer = self._buffer[len(self.CLOSE) :]
                text, more = self._close(closed=True)
                content.append(text)
                deltas += more
                continue
            start = self._buffer.find(self.OPEN)
            if start < 0:
                keep = partial_tag_length(self._buffer, self.OPEN)
                content.append(self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep :]
                return "".join(content), deltas
            content.append(self._buffer[:start])
            self._buffer = self._buffer[start + len(self.OPEN) :]
            self._call = _CallObject(self._num_calls, self.names)

    def finish(self) -> ParsedText:
        """What is left: an unclosed call still counts if it streamed or its JSON is whole."""
        rest, self._buffer = self._buffer, ""
        if self._call is None:
            return rest, []
        deltas = self._call.feed(rest)
        text, more = self._close(closed=False)
        return text, deltas + more

    def _close(self, closed: bool) -> ParsedText:
        """The end of the call's text: its last piece, or the text as content if it is no call
        (``closed``: by its tag)."""
        call, self._call = self._call, None
        if call.streaming:
            self._num_calls += 1
            self.broken |= not call.complete
            return "", []
        whole = call.whole()
        if whole is None:
            self.broken = True
            return self.OPEN + call.text + (self.CLOSE if closed else ""), []
        self._num_calls += 1
        return "", [whole]


class Llama3JsonToolParser:
    """Llama 3: the whole reply is ``{"name": ..., "parameters": {...}}`` (``;``-separated for
    several calls, optionally after ``<|python_tag|>``); any other reply is content, and so is
    what follows the calls once it is not one."""

    TAG = "<|python_tag|>"

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names
        self.broken = False  # a streamed call did not end as a call
        self._buffer = ""
        self._is_call: bool | None = None  # undecided until the first visible character
        self._calls: list[_CallObject] = []  # the last one may still be streaming
        self._content = False  # past the calls: the rest is content

    def feed(self, text: str) -> ParsedText:
        if self._is_call is False or self._content:
            return text, []
        self._buffer += text
        if self._is_call is None:
            start = self._buffer.lstrip()
            if not start or (len(start) < len(self.TAG) and self.TAG.startswith(start)):
                return "", []
            self._is_call = start.startswith(("{", self.TAG))
            if not self._is_call:
                rest, self._buffer = self._buffer, ""
                return rest, []
            self._buffer = start.removeprefix(self.TAG)
        return self._calls_in_buffer()

    def _calls_in_buffer(self) -> ParsedText:
        deltas = []
        while self._buffer:
            call = self._calls[-1] if self._calls and self._calls[-1].end is None else None
            if call is None:
                self._buffer = self._buffer.lstrip(" \n;")
                if not self._buffer:
                    break
                if not self._buffer.startswith("{"):
                    return self._give_up(deltas)
                call = _CallObject(len(self._calls), self.names)
                self._calls.append(call)
            deltas += call.feed(self._buffer)
            if call.end is None:
                self._buffer = ""
                break
            self._buffer = call.text[call.end :]
            call.text = call.text[: call.end]
            self.broken |= call.streaming and not call.complete
            if not call.streaming:
                whole = call.whole()
                if whole is None:
                    self._buffer = call.text + self._buffer
                    self._calls.pop()
                    return self._give_up(deltas)
                deltas.append(whole)
        return "", deltas

    def _give_up(self, deltas: list[ToolCallDelta]) -> ParsedText:
        """The rest is not a call: content from here on."""
        self._content = True
        rest, self._buffer = self._buffer, ""
        return rest, deltas

    def finish(self) -> ParsedText:
        if self._is_call is None:
            rest, self._buffer = self._buffer, ""
            return rest, []
        if self._is_call is False or self._content:
            return "", []
        open_call = self._calls[-1] if self._calls and self._calls[-1].end is None else None
        if open_call is None or open_call.streaming:
            self.broken |= open_call is not None  # a streamed call cut short
            return "", []
        self._calls.pop()
        self._buffer = open_call.text
        return self._give_up([])


class ForcedToolParser:
    """``tool_choice="required"`` (a JSON array of ``{"name", "parameters"}``) or a named
    function (a JSON object, its arguments): the grammar made the text, so it is all calls,
    each sent whole at the end."""

    broken = False  # what is not a call stays text

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
            call = _whole_call(0, self._function_name, data)
            return ("", [call]) if call is not None else (rest, [])
        items = data if isinstance(data, list) else []
        calls = [
            _whole_call(index, item.get("name"), item.get("parameters"))
            for index, item in enumerate(items)
            if isinstance(item, dict)
        ]
        return ("", calls) if calls and len(calls) == len(items) and all(calls) else (rest, [])


TOOL_PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}


def forced_tool_schema(
    tools: list[ChatTool], choice: str | NamedToolChoice, parallel: bool
) -> dict[str, Any] | None:
    """The JSON schema that makes ``required`` or a named choice a tool call (None otherwise);
    ``ValueError`` if the named function is not among the tools. ``required`` makes at most
    one call per tool (one in all unless ``parallel``): an unbounded array would let a model
    repeat calls until ``max_tokens``."""
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
    return {
        "type": "array",
        "items": {"anyOf": calls},
        "minItems": 1,
        "maxItems": len(calls) if parallel else 1,
    }
