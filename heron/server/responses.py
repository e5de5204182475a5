"""Responses API output: a reply's pieces as output items and events, and the store of finished
responses that ``previous_response_id`` continues."""

from __future__ import annotations

import copy
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel

from heron.server.chat_output import MessagePiece
from heron.server.protocol import Usage
from heron.server.responses_protocol import ResponsesRequest
from heron.server.tool_parsers import ToolCallDelta
from heron.structured import ReasoningTokens

Event = dict[str, Any]


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def new_response(body: ResponsesRequest, response_id: str, model: str) -> dict[str, Any]:
    """The response object before any output, echoing the request's settings as OpenAI does."""
    choice = body.tool_choice or ("auto" if body.tools else "none")
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "model": model,
        "output": [],
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {},
        "parallel_tool_calls": body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "store": body.store,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tool_choice": choice.model_dump() if isinstance(choice, BaseModel) else choice,
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
        "text": body.text.model_dump(by_alias=True, exclude_none=True)
        if body.text
        else {"format": {"type": "text"}},
        "truncation": "disabled",
        "usage": None,
    }


class ResponseWriter:
    """Builds one response from its reply's pieces (reasoning, text, tool calls, as the chat
    output parser splits them) and yields the Responses stream's events on the way: an item
    opens when its kind of output starts and closes when another kind follows or the reply
    ends."""

    def __init__(self, response: dict[str, Any]) -> None:
        self.response = response
        self._open: dict[str, Any] | None = None
        self._sequence = 0

    def _event(self, kind: str, **fields: Any) -> Event:
        # A copy: the items it shows change as the reply goes on.
        event = {"type": kind, "sequence_number": self._sequence, **copy.deepcopy(fields)}
        self._sequence += 1
        return event

    def start(self) -> list[Event]:
        return [
            self._event("response.created", response=self.response),
            self._event("response.in_progress", response=self.response),
        ]

    def feed(self, piece: MessagePiece) -> list[Event]:
        events = []
        if piece.reasoning:
            events += self._text("reasoning", piece.reasoning)
        if piece.content:
            events += self._text("message", piece.content)
        for call in piece.tool_calls:
            events += self._call(call)
        return events

    def finish(self, finish_reason: str | None, usage: Usage, reasoning_tokens: int) -> list[Event]:
        """Close the last item and complete the response (incomplete when it ran out of
        ``max_output_tokens``)."""
        incomplete = finish_reason == "length"
        events = self._close("incomplete" if incomplete else "completed")
        if not self.response["output"]:  # an empty reply is an empty message
            events += self._text("message", "")
            events += self._close("completed")
        self.response.update(
            status="incomplete" if incomplete else "completed",
            incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
            usage={
                "input_tokens": usage.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": usage.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                "total_tokens": usage.total_tokens,
            },
        )
        kind = "response.incomplete" if incomplete else "response.completed"
        return [*events, self._event(kind, response=self.response)]

    def fail(self, message: str) -> list[Event]:
        self.response.update(status="failed", error={"code": "server_error", "message": message})
        return [self._event("response.failed", response=self.response)]

    # ---------------------------------------------------------------- items

    def _where(self) -> dict[str, Any]:
        item = self._open
        assert item is not None
        return {"item_id": item["id"], "output_index": len(self.response["output"])}

    def _add(self, item: dict[str, Any]) -> list[Event]:
        self._open = item
        return [self._event("response.output_item.added", item=item, **_index(self._where()))]

    def _text(self, kind: str, text: str) -> list[Event]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close("completed")
            if kind == "message":
                item = {"id": _id("msg"), "type": "message", "role": "assistant", "content": []}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            else:
                item = {"id": _id("rs"), "type": "reasoning", "summary": [], "content": []}
                part = {"type": "reasoning_text", "text": ""}
            events += self._add({**item, "status": "in_progress"})
            events.append(
                self._event(
                    "response.content_part.added", content_index=0, part=part, **self._where()
                )
            )
            self._open["content"].append(dict(part))
        self._open["content"][0]["text"] += text
        delta = (
            "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        )
        extra = {"logprobs": []} if kind == "message" else {}
        events.append(self._event(delta, content_index=0, delta=text, **extra, **self._where()))
        return events

    def _call(self, call: ToolCallDelta) -> list[Event]:
        events = []
        if call.id is not None:  # a call's first piece
            events += self._close("completed")
            item = {
                "id": _id("fc"),
                "type": "function_call",
                "call_id": call.id,
                "name": call.name,
                "arguments": "",
                "status": "in_progress",
            }
            events += self._add(item)
        if call.arguments:
            self._open["arguments"] += call.arguments
            events.append(
                self._event(
                    "response.function_call_arguments.delta", delta=call.arguments, **self._where()
                )
            )
        return events

    def _close(self, status: str) -> list[Event]:
        item, self._open = self._open, None
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": len(self.response["output"])}
        events = []
        if item["type"] == "function_call":
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    name=item["name"],
                    arguments=item["arguments"],
                    **where,
                )
            )
        else:
            part = item["content"][0]
            text_done = (
                "response.output_text.done"
                if item["type"] == "message"
                else ("response.reasoning_text.done")
            )
            extra = {"logprobs": []} if item["type"] == "message" else {}
            events.append(
                self._event(text_done, content_index=0, text=part["text"], **extra, **where)
            )
            events.append(
                self._event("response.content_part.done", content_index=0, part=part, **where)
            )
        item["status"] = status
        self.response["output"].append(item)
        events.append(self._event("response.output_item.done", item=item, **_index(where)))
        return events


def _index(where: dict[str, Any]) -> dict[str, Any]:
    return {"output_index": where["output_index"]}


def output_turn(output: list[dict[str, Any]]) -> dict[str, Any]:
    """A response's output as the assistant's chat turn (its reasoning left out, as chat
    templates leave past reasoning out)."""
    text = "".join(
        part["text"] for item in output if item["type"] == "message" for part in item["content"]
    )
    turn: dict[str, Any] = {"role": "assistant", "content": text}
    calls = [
        {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        for item in output
        if item["type"] == "function_call"
    ]
    if calls:
        turn["tool_calls"] = calls
    return turn


class ResponseStore:
    """Finished responses kept in memory for ``previous_response_id`` and ``GET``: at most
    ``max_size``, each for ``max_age_s`` seconds of ``clock`` (the oldest go first)."""

    def __init__(
        self, max_size: int, max_age_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_size, self.max_age_s, self._clock = max_size, max_age_s, clock
        # id -> (time stored, the response, the conversation up to and with its reply)
        self._entries: OrderedDict[str, tuple[float, dict[str, Any], list[dict[str, Any]]]] = (
            OrderedDict()
        )

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        self._entries[response["id"]] = (self._clock(), response, conversation)
        self._expire()
        while len(self._entries) > self.max_size:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        self._expire()
        entry = self._entries.get(response_id)
        return None if entry is None else entry[1:]

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None

    def _expire(self) -> None:
        oldest = self._clock() - self.max_age_s
        while self._entries and next(iter(self._entries.values()))[0] < oldest:
            self._entries.popitem(last=False)


def reasoning_token_count(token_ids: Sequence[int], tokens: ReasoningTokens | None) -> int:
    """How many of a reply's tokens are its think block's (0 without a reasoning parser): from
    its start (the first token, or the one after ``start``) to ``end`` or the reply's end."""
    if tokens is None:
        return 0
    first = 0
    if tokens.start is not None:
        if tokens.start not in token_ids:
            return 0
        first = token_ids.index(tokens.start) + 1
    last = token_ids.index(tokens.end) if tokens.end in token_ids else len(token_ids)
    return last - first
