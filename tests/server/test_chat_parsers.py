"""Tool-call and reasoning parsers: whole texts, and the same texts streamed in pieces."""

from __future__ import annotations

import json

import pytest

from heron.server.chat_output import ChatOutputConfig, ChatOutputParser
from heron.server.reasoning import reasoning_tokens
from heron.server.structured_protocol import ChatTool, NamedToolChoice
from heron.server.tool_parsers import forced_tool_schema, join_tool_calls
from heron.structured import ReasoningTokens

from tiny_models import make_tokenizer

HERMES = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
)
LLAMA3 = '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'
TOOLS = [
    ChatTool.model_validate(
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ),
    ChatTool.model_validate({"type": "function", "function": {"name": "get_time"}}),
]


def _feed(config, text, chunk, choice="auto"):
    """(reasoning, content, tool-call pieces) with the text fed ``chunk`` characters at a time
    (0: whole)."""
    parser = ChatOutputParser(config, TOOLS, choice)
    pieces = [text[i : i + chunk] for i in range(0, len(text), chunk)] if chunk else [text]
    reasoning, content, deltas = "", "", []
    for piece in [*map(parser.feed, pieces), parser.finish()]:
        reasoning += piece.reasoning
        content += piece.content
        deltas += piece.tool_calls
    return reasoning, content, deltas


def _parse(config, text, chunk, choice="auto"):
    """(reasoning, content, [(name, arguments)]), the calls' pieces in OpenAI's order: the
    first of each call (and only it) has the id and name, the calls follow each other."""
    reasoning, content, deltas = _feed(config, text, chunk, choice)
    firsts = [d.index for d in deltas if d.id is not None]
    assert firsts == sorted(set(firsts)) == list(range(len(firsts)))
    assert all((d.id is None) == (d.name is None) for d in deltas)
    assert [d.index for d in deltas] == sorted(d.index for d in deltas)
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in join_tool_calls(deltas)]
    return reasoning, content, calls


WEATHER_AND_TIME = [("get_weather", {"city": "Paris"}), ("get_time", {})]


@pytest.mark.parametrize("chunk", [0, 1, 3])
def test_hermes_calls_and_content(chunk):
    config = ChatOutputConfig(tool_call_parser="hermes", enable_auto_tool_choice=True)
    assert _parse(config, HERMES, chunk) == ("", "Let me check. \n", WEATHER_AND_TIME)
    # Text that only looks like a tag's start, and a call whose JSON is broken, stay content.
    assert _parse(config, "a <tool b <tool_call>{bad</tool_call>", chunk) == (
        "",
        "a <tool b <tool_call>{bad</tool_call>",
        [],
    )


@pytest.mark.parametrize("chunk", [0, 1, 4])
def test_llama3_json_calls_and_plain_replies(chunk):
    config = ChatOutputConfig(tool_call_parser="llama3_json", enable_auto_tool_choice=True)
    assert _parse(config, LLAMA3, chunk) == ("", "", WEATHER_AND_TIME)
    assert _parse(config, "<|python_tag|>" + LLAMA3, chunk) == ("", "", WEATHER_AND_TIME)
    assert _parse(config, "Paris is sunny.", chunk) == ("", "Paris is sunny.", [])


@pytest.mark.parametrize("name,text", [("hermes", HERMES), ("llama3_json", LLAMA3)])
def test_arguments_stream_as_they_arrive(name, text):
    """Fed a character at a time: the call is named once its arguments open, each argument
    character goes out when it arrives, and the call's last piece with its closing brace."""
    config = ChatOutputConfig(tool_call_parser=name, enable_auto_tool_choice=True)
    parser = ChatOutputParser(config, TOOLS, "auto")
    sent = [(i + 1, d) for i in range(len(text)) for d in parser.feed(text[i]).tool_calls]
    first_call = [(fed, d) for fed, d in sent if d.index == 0]
    arguments = '{"city": "Paris"}'
    opened = text.index(arguments) + 1
    assert first_call[0][0] == opened and first_call[0][1].name == "get_weather"
    assert [fed for fed, _ in first_call] == list(range(opened, opened + len(arguments)))
    assert "".join(d.arguments for _, d in first_call) == arguments


def test_calls_in_another_key_order_go_out_whole():
    config = ChatOutputConfig(tool_call_parser="hermes", enable_auto_tool_choice=True)
    text = '<tool_call>{"arguments": {"zone": "utc"}, "name": "get_time"}</tool_call>'
    reasoning, content, deltas = _feed(config, text, 1)
    (call,) = deltas
    assert (call.name, json.loads(call.arguments)) == ("get_time", {"zone": "utc"})


HERMES_CONFIG = ChatOutputConfig(tool_call_parser="hermes", enable_auto_tool_choice=True)
LLAMA3_CONFIG = ChatOutputConfig(tool_call_parser="llama3_json", enable_auto_tool_choice=True)


@pytest.mark.parametrize(
    "config, text",
    [
        # arguments cut by the closing tag
        (
            HERMES_CONFIG,
            'Sure. <tool_call>{"name": "get_weather", "arguments": {"a": 2</tool_call>',
        ),
        # the object not closed
        (HERMES_CONFIG, '<tool_call>{"name": "get_time", "arguments": {}</tool_call>'),
        # a function not in tools
        (HERMES_CONFIG, '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'),
        # a good call, then a broken one: the whole reply is content
        (HERMES_CONFIG, HERMES + '<tool_call>{"name": "get_time", "arguments": [}</tool_call>'),
        # cut short (max_tokens)
        (HERMES_CONFIG, '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa'),
        (LLAMA3_CONFIG, '{"name": "get_weather", "parameters": {"city": "Pa'),
        (LLAMA3_CONFIG, '{"name": "add", "parameters": {"a": 2}}'),
    ],
)
def test_replies_with_calls_that_are_not_valid_are_content(config, text):
    """As vLLM's parsers fall back: the reply as it was generated, no tool call."""
    piece = ChatOutputParser(config, TOOLS, "auto").whole(text)
    assert (piece.content, piece.tool_calls) == (text, [])


@pytest.mark.parametrize("chunk", [1, 4])
@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "get_weather", "arguments": {"a": 2</tool_call>',
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa',
    ],
)
def test_a_streamed_call_that_ends_broken_is_reported(chunk, text):
    parser = ChatOutputParser(HERMES_CONFIG, TOOLS, "auto")
    for i in range(0, len(text), chunk):
        parser.feed(text[i : i + chunk])
    parser.finish()
    assert parser.broken


@pytest.mark.parametrize("chunk", [1, 4])
def test_a_function_not_in_tools_is_never_sent(chunk):
    text = 'ok <tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'
    assert _feed(HERMES_CONFIG, text, chunk) == ("", text, [])


@pytest.mark.parametrize("config, text", [(HERMES_CONFIG, HERMES), (LLAMA3_CONFIG, LLAMA3)])
def test_valid_calls_are_not_broken(config, text):
    parser = ChatOutputParser(config, TOOLS, "auto")
    assert len(parser.whole(text).tool_calls) == 2 and not parser.broken


@pytest.mark.parametrize("chunk", [0, 1, 5])
def test_reasoning_split(chunk):
    qwen3 = ChatOutputConfig(reasoning_parser="qwen3")
    r1 = ChatOutputConfig(reasoning_parser="deepseek_r1")
    text = "<think>two steps</think>The answer."
    assert _parse(qwen3, text, chunk, "none") == ("two steps", "The answer.", [])
    assert _parse(qwen3, "No thinking.", chunk, "none") == ("", "No thinking.", [])
    assert _parse(r1, "two steps</think>The answer.", chunk, "none") == (
        "two steps",
        "The answer.",
        [],
    )
    assert _parse(r1, text, chunk, "none") == ("two steps", "The answer.", [])
    assert _parse(qwen3, "<think>cut off", chunk, "none") == ("cut off", "", [])


@pytest.mark.parametrize("chunk", [0, 2])
def test_reasoning_then_hermes_call(chunk):
    config = ChatOutputConfig("qwen3", "hermes", True)
    text = '<think>need weather</think><tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    assert _parse(config, text, chunk) == ("need weather", "", [("get_time", {})])


def test_forced_choices():
    config = ChatOutputConfig()
    required = '[{"name": "get_weather", "parameters": {"city": "Rome"}}]'
    assert _parse(config, required, 2, "required") == ("", "", [("get_weather", {"city": "Rome"})])
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_time"}})
    assert _parse(config, "{}", 0, named) == ("", "", [("get_time", {})])
    assert _parse(config, '{"cut', 0, named) == ("", '{"cut', [])  # cut short: kept as text
    schema = forced_tool_schema(TOOLS, "required", parallel=False)
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    # parallel calls: at most one per tool, so a grammar cannot repeat calls until max_tokens
    assert forced_tool_schema(TOOLS, "required", parallel=True)["maxItems"] == 2
    assert forced_tool_schema(TOOLS, named, parallel=True) == {"type": "object", "properties": {}}
    missing = NamedToolChoice.model_validate({"function": {"name": "nope"}})
    with pytest.raises(ValueError, match="'nope', which is not in tools"):
        forced_tool_schema(TOOLS, missing, parallel=True)


def test_config_refuses_unknown_parsers_and_auto_without_parser():
    with pytest.raises(ValueError, match="unknown tool call parser 'x'; known: hermes"):
        ChatOutputConfig(tool_call_parser="x")
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        ChatOutputConfig(reasoning_parser="x")
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        ChatOutputConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="--enable-auto-tool-choice"):
        ChatOutputConfig(tool_call_parser="hermes").check_tool_choice(True, "auto")
    with pytest.raises(ValueError, match="tool_choice needs tools"):
        ChatOutputConfig().check_tool_choice(False, "required")
    ChatOutputConfig().check_tool_choice(True, "required")
    hermes = ChatOutputConfig(tool_call_parser="hermes", enable_auto_tool_choice=True)
    assert hermes.keeps_special_tokens(True, "auto")
    assert not hermes.keeps_special_tokens(True, "none")


def test_serve_refuses_an_unknown_parser_before_loading_the_model(capsys):
    from heron.cli import main

    assert main(["serve", "--model", "/no/such/model", "--tool-call-parser", "bad"]) == 2
    assert "unknown tool call parser 'bad'" in capsys.readouterr().err


def test_reasoning_tokens_must_be_single_tokens():
    with pytest.raises(ValueError, match="needs <think> and </think> as one token"):
        reasoning_tokens("qwen3", make_tokenizer())
    tokenizer = make_tokenizer()
    tokenizer.add_tokens(["<think>", "</think>"])
    assert reasoning_tokens("qwen3", tokenizer) == ReasoningTokens(end=321, start=320)
    assert reasoning_tokens("deepseek_r1", tokenizer) == ReasoningTokens(end=321)


@pytest.mark.parametrize("chunk", [0, 1])
def test_llama3_text_after_the_calls_is_content(chunk):
    config = ChatOutputConfig(tool_call_parser="llama3_json", enable_auto_tool_choice=True)
    text = '{"name": "get_time", "parameters": {}}; and that is all'
    assert _parse(config, text, chunk) == ("", "and that is all", [("get_time", {})])
