"""One chat choice's text as the assistant message: reasoning first, then content and tool
calls, streamed or whole."""

from __future__ import annotations

from dataclasses import dataclass, field

from heron.server.reasoning import REASONING_STARTS_OPEN, reasoning_parser
from heron.server.structured_protocol import ChatTool, NamedToolChoice, ToolChoice
from heron.server.tool_parsers import TOOL_PARSERS, ForcedToolParser, ToolCallDelta


@dataclass
class MessagePiece:
    """What a stretch of text adds to the message."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __add__(self, other: MessagePiece) -> MessagePiece:
        return MessagePiece(
            self.reasoning + other.reasoning,
            self.content + other.content,
            self.tool_calls + other.tool_calls,
        )


@dataclass(frozen=True)
class ChatOutputConfig:
    """The server's parsers (``--reasoning-parser``, ``--tool-call-parser`` with
    ``--enable-auto-tool-choice``), by name; None: not enabled."""

    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False

    def __post_init__(self) -> None:
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_STARTS_OPEN:
            raise ValueError(
                f"unknown reasoning parser {self.reasoning_parser!r}; "
                f"known: {', '.join(REASONING_STARTS_OPEN)}"
            )
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(
                f"unknown tool call parser {self.tool_call_parser!r}; "
                f"known: {', '.join(TOOL_PARSERS)}"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")

    def check_tool_choice(self, has_tools: bool, choice: ToolChoice) -> None:
        """A choice other than ``none`` needs tools, and ``auto`` the auto tool choice enabled,
        as in vLLM (a ``ValueError`` if not)."""
        if not has_tools and choice != "none":
            raise ValueError("tool_choice needs tools")
        if has_tools and choice == "auto" and not self.enable_auto_tool_choice:
            raise ValueError(
                'tool_choice "auto" needs the server started with --enable-auto-tool-choice '
                "and --tool-call-parser"
            )

    def keeps_special_tokens(self, has_tools: bool, choice: ToolChoice) -> bool:
        """Whether replies must keep special tokens: some Hermes models' ``<tool_call>`` is
        one, and dropping it from the text would hide the call (vLLM does the same)."""
        return has_tools and choice == "auto" and self.tool_call_parser == "hermes"


class ChatOutputParser:
    """Splits a choice's text (``feed`` per delta, then ``finish``; ``whole`` for a reply that
    is not streamed) into message pieces."""

    def __init__(
        self, config: ChatOutputConfig, tools: list[ChatTool] | None, choice: ToolChoice
    ) -> None:
        name = config.reasoning_parser
        self._reasoning = reasoning_parser(name) if name is not None else None
        has_tools = bool(tools)
        self._tools = None
        self._tool_text = ""  # the text the tool parser read
        if has_tools and isinstance(choice, NamedToolChoice):
            self._tools = ForcedToolParser(choice.function.name)
        elif has_tools and choice == "required":
            self._tools = ForcedToolParser(None)
        elif has_tools and choice == "auto":
            names = frozenset(t.function.name for t in tools)
            self._tools = TOOL_PARSERS[config.tool_call_parser](names)

    @property
    def active(self) -> bool:
        return self._reasoning is not None or self._tools is not None

    @property
    def broken(self) -> bool:
        """Whether a tool call the parser sent did not end as a valid call."""
        return self._tools is not None and self._tools.broken

    def whole(self, text: str) -> MessagePiece:
        """The message of a whole reply; one with a broken tool call is plain content."""
        piece = self.feed(text) + self.finish()
        return MessagePiece(piece.reasoning, self._tool_text) if self.broken else piece

    def feed(self, text: str) -> MessagePiece:
        reasoning, content = self._reasoning.feed(text) if self._reasoning else ("", text)
        return self._with_tools(reasoning, content, finish=False)

    def finish(self) -> MessagePiece:
        reasoning, content = self._reasoning.finish() if self._reasoning else ("", "")
        return self._with_tools(reasoning, content, finish=True)

    def _with_tools(self, reasoning: str, content: str, finish: bool) -> MessagePiece:
        if self._tools is None:
            return MessagePiece(reasoning, content)
        self._tool_text += content
        content, calls = self._tools.feed(content)
        if finish:
            rest, more = self._tools.finish()
            content, calls = content + rest, calls + more
        return MessagePiece(reasoning, content, calls)
