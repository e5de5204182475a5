"""Structured outputs and tool calls through the official client: grammars against the
session's server, tools against a server of the tiny random model with a template that shows
the tools and the hermes tool parser (reasoning: test_reasoning_outputs.py)."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from json_schemas import SCHEMAS
from openai_server import (
    API_KEY,
    MODEL_NAME,
    accumulated_tool_calls,
    openai_client,
    start_server,
    stop_server,
)
from tiny_models import CHAT_TEMPLATE

# The tiny template, showing the model its tools as chat templates of tool models do (names
# and parameters only: the prompt must leave room in the tiny context for a whole call).
TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>{% for t in tools %}"
    "{{ t.function.name }}: {{ t.function.parameters | tojson }}"
    "{% endfor %}<|end|>{% endif %}" + CHAT_TEMPLATE
)
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,5}$"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["utc", "cet"]}},
                "required": ["zone"],
            },
        },
    },
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def tools_server(tiny_model_dir, tmp_path_factory):
    """The tiny model, its template replaced by ``--chat-template FILE``."""
    template = tmp_path_factory.mktemp("template") / "tools.jinja"
    template.write_text(TOOLS_TEMPLATE)
    flags = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    handle = start_server(
        tiny_model_dir("qwen2"), "--api-key", API_KEY, "--chat-template", str(template), *flags
    )
    yield handle
    stop_server(handle)


@pytest.fixture(scope="module")
def tools_client(tools_server):
    return openai_client(tools_server)


def _chat(client, **kwargs):
    return client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **kwargs)


def test_json_schema_samples_all_validate(client):
    """50 of 50 samples at temperature 1, over two schemas, each sample parsed and validated."""
    validated = 0
    for schema, n in zip(SCHEMAS, (25, 25)):
        response = _chat(
            client,
            n=n,
            temperature=1.0,
            max_tokens=96,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "record", "schema": schema, "strict": True},
            },
        )
        for choice in response.choices:
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content), schema)
            validated += 1
    assert validated == 50


def _complete(client, prompt, n, **kwargs):
    return client.completions.create(
        model=MODEL_NAME, prompt=prompt, n=n, temperature=1.0, max_tokens=16, **kwargs
    )


def test_regex_and_choice_on_completions_streamed_and_not(client):
    regex = r"[a-c]{2}-\d{3}"
    response = _complete(client, "code:", 3, extra_body={"structured_outputs": {"regex": regex}})
    assert [re.fullmatch(regex, c.text) is not None for c in response.choices] == [True] * 3
    choices = ["yes", "no", "it depends"]
    # (guided_choice: vLLM's older name)
    stream = _complete(client, "answer:", 2, stream=True, extra_body={"guided_choice": choices})
    texts = ["", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert all(t in choices for t in texts), texts


@pytest.mark.parametrize(
    "body,message",
    [
        (
            {"structured_outputs": {"regex": "a"}, "guided_regex": "b"},
            "give only one of structured_outputs, guided_regex",
        ),
        ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex is invalid"),
        ({"structured_outputs": {"whitespace": "x"}}, "structured_outputs.whitespace"),
        ({"response_format": {"type": "json_schema"}}, "needs json_schema"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ],
)
def test_bad_constraints_are_400_naming_the_field(http, body, message):
    response = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, **body})
    assert response.status_code == 400 and message in response.json()["error"]["message"]


def _streamed_calls(stream):
    """(content, calls as {index: (name, arguments)}, finish reason, pieces per call) of a
    streamed choice 0, accumulated by the openai client."""
    choice, pieces = accumulated_tool_calls(stream)
    calls = {
        i: (c.function.name, json.loads(c.function.arguments))
        for i, c in enumerate(choice.message.tool_calls or [])
    }
    return choice.message.content or "", calls, choice.finish_reason, pieces


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_tool_choice(tools_client, stream):
    kwargs = dict(
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,  # one call each: a random model's list could run on
        temperature=1.0,
        max_tokens=96,
        seed=5,
    )
    if not stream:
        response = _chat(tools_client, n=4, **kwargs)
        for choice in response.choices:
            assert choice.finish_reason == "tool_calls", choice.message.content
            assert choice.message.content is None
            (call,) = choice.message.tool_calls
            assert call.type == "function" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
        return
    content, calls, finish, _ = _streamed_calls(_chat(tools_client, stream=True, **kwargs))
    assert content == "" and finish == "tool_calls" and list(calls) == [0]
    for name, arguments in calls.values():
        jsonschema.validate(arguments, PARAMETERS[name])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_named_tool_choice(tools_client, stream):
    named = {"type": "function", "function": {"name": "get_weather"}}
    kwargs = dict(tools=TOOLS, tool_choice=named, temperature=1.0, max_tokens=64, seed=6)
    if not stream:
        (choice,) = _chat(tools_client, **kwargs).choices
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
        return
    content, calls, finish, _ = _streamed_calls(_chat(tools_client, stream=True, **kwargs))
    assert finish == "tool_calls" and list(calls) == [0] and calls[0][0] == "get_weather"
    jsonschema.validate(calls[0][1], WEATHER)


# A hermes-format reply, made by a grammar (a random model does not call tools on its own).
HERMES_REPLY = (
    r'ok <tool_call>\{"name": "get_time", "arguments": \{"zone": "(utc|cet)"\}\}</tool_call>'
)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_auto_tool_choice_parses_hermes_calls(tools_client, stream):
    kwargs = dict(
        tools=TOOLS, max_tokens=128, extra_body={"structured_outputs": {"regex": HERMES_REPLY}}
    )
    if not stream:
        (choice,) = _chat(tools_client, **kwargs).choices
        assert choice.finish_reason == "tool_calls" and choice.message.content == "ok "
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_time"
        assert json.loads(call.function.arguments)["zone"] in ("utc", "cet")
        return
    content, calls, finish, pieces = _streamed_calls(_chat(tools_client, stream=True, **kwargs))
    assert content == "ok " and finish == "tool_calls" and calls[0][0] == "get_time"
    assert calls[0][1]["zone"] in ("utc", "cet")
    assert len(pieces[0]) > 1  # the arguments in fragments, as they were generated


def test_tools_reach_the_template_and_bad_choices_are_400(tools_client):
    plain = _chat(tools_client, max_tokens=1, temperature=0)
    with_tools = _chat(tools_client, max_tokens=1, temperature=0, tools=TOOLS, tool_choice="none")
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 20
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        _chat(
            tools_client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "x"}}
        )


# Hermes-format replies that are not valid calls, made by grammars: arguments cut by the closing
# tag, and a function not in tools.
NOT_CALLS = [
    r'ok <tool_call>\{"name": "get_time", "arguments": \{"zone": "utc"</tool_call>',
    r'ok <tool_call>\{"name": "add", "arguments": \{"a": 2\}\}</tool_call>',
]


@pytest.mark.parametrize("regex", NOT_CALLS, ids=["broken", "unknown"])
def test_hermes_replies_that_are_not_valid_calls_are_content(tools_server, tools_client, regex):
    kwargs = dict(tools=TOOLS, max_tokens=128, extra_body={"structured_outputs": {"regex": regex}})
    (choice,) = _chat(tools_client, **kwargs).choices
    text = regex.replace("\\", "")
    assert (choice.message.content, choice.message.tool_calls) == (text, [])
    assert choice.finish_reason == "stop"
    # A stream cannot take back the arguments it sent; it ends as a reply, not as calls.
    streamed, _ = accumulated_tool_calls(_chat(tools_client, stream=True, **kwargs))
    assert streamed.finish_reason == "stop"
    if "add" in regex:  # never sent as a call
        assert (streamed.message.content, streamed.message.tool_calls) == (text, None)
    tools_server.wait_idle(timeout=30)


def test_required_parallel_calls_are_bounded(tools_client):
    """At most one call per tool: an unbounded array let a random model loop to max_tokens."""
    forced = dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=True)
    response = _chat(tools_client, temperature=1.0, max_tokens=200, n=5, seed=11, **forced)
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls", choice.message.content
        assert choice.message.content is None and 1 <= len(choice.message.tool_calls) <= 2
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
