"""``/v1/responses`` through the official client's ``client.responses``: the reply equals the
chat path's, the event stream is what the client's own stream parser accumulates, tool calls
round trip, ``text.format`` holds, ``previous_response_id`` continues a stored conversation
(the prompts checked against the tokenizer's own chat template), and refusals name the field."""

from __future__ import annotations

import json
import shutil

import jsonschema
import openai
import pytest
from openai.lib.streaming.responses import ResponseStreamState
from transformers import AutoTokenizer

from heron.server.chat_output import MessagePiece
from heron.server.protocol import Usage
from heron.server.responses import ResponseStore, ResponseWriter, new_response
from heron.server.responses_protocol import ResponsesRequest
from heron.server.tool_parsers import ToolCallDelta

from json_schemas import SCHEMAS
from openai_server import API_KEY, MODEL_NAME, openai_client, start_server, stop_server
from tiny_models import CHAT_TEMPLATE

# The tiny template, showing the model its tools and past calls as tool models' templates do.
TEMPLATE = (
    "{% if tools %}<|system|>{% for t in tools %}{{ t.function.name }}"
    "{% endfor %}<|end|>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}"
    "{{ c.function.arguments | tojson }}</tool_call>{% endfor %}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
assert CHAT_TEMPLATE.startswith("{% for m in messages %}")
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Oslo"]}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("responses-model")
    shutil.copytree(tiny_model_dir("qwen2"), path, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def client(model_dir):
    flags = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    handle = start_server(model_dir, "--api-key", API_KEY, *flags)
    yield openai_client(handle)
    stop_server(handle)


def _prompt_tokens(model_dir, messages, tools=None) -> int:
    """The prompt's length by the tokenizer's own chat template (the reference)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    return len(ids)


def test_text_equals_the_chat_reply_streamed_or_not(client, model_dir):
    kwargs = dict(model=MODEL_NAME, temperature=0, max_output_tokens=12)
    response = client.responses.create(input="Tell me a story.", instructions="Be kind.", **kwargs)
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        temperature=0,
        max_tokens=12,
        messages=[
            {"role": "system", "content": "Be kind."},
            {"role": "user", "content": "Tell me a story."},
        ],
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.object == "response" and response.instructions == "Be kind."
    assert response.status == "incomplete"  # it ran out of max_output_tokens
    assert response.incomplete_details.reason == "max_output_tokens"
    assert (
        response.usage.input_tokens
        == chat.usage.prompt_tokens
        == _prompt_tokens(
            model_dir,
            [
                {"role": "system", "content": "Be kind."},
                {"role": "user", "content": "Tell me a story."},
            ],
        )
    )
    assert response.usage.output_tokens == 12

    kwargs["max_output_tokens"] = 8
    whole = client.responses.create(input="Hello", **kwargs)
    with client.responses.stream(input="Hello", **kwargs) as stream:
        events = list(stream)
    types = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[4 : 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert types[4 + len(deltas) :] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(deltas) == whole.output_text == events[-1].response.output[0].content[0].text


def test_null_means_unset(client):
    """Clients other than the official SDK send nulls for the fields they leave out."""
    body = dict(model=MODEL_NAME, input="Hello", temperature=0, max_output_tokens=6)
    nulls = dict.fromkeys(
        ["parallel_tool_calls", "stream", "store", "tools", "tool_choice", "text", "user"]
    )
    plain = client.responses.create(**body)
    with_nulls = client.responses.create(**body, extra_body=nulls)
    assert with_nulls.output_text == plain.output_text


def test_streamed_completion_reaches_the_clients_final_response(client):
    with client.responses.stream(
        model=MODEL_NAME,
        input="Hi",
        max_output_tokens=64,
        text={"format": {"type": "json_schema", "name": "r", "schema": SCHEMAS[0]}},
    ) as stream:
        final = stream.get_final_response()
    assert final.status == "completed"
    jsonschema.validate(json.loads(final.output_text), SCHEMAS[0])


def test_json_schema_format_validates(client):
    for seed_text in ("A record:", "Another one:"):
        response = client.responses.create(
            model=MODEL_NAME,
            input=seed_text,
            temperature=1.0,
            max_output_tokens=96,
            text={
                "format": {"type": "json_schema", "name": "r", "schema": SCHEMAS[0], "strict": True}
            },
        )
        assert response.status == "completed", response.output_text
        jsonschema.validate(json.loads(response.output_text), SCHEMAS[0])


@pytest.mark.parametrize("stream", [False, True])
def test_function_call_round_trip(client, model_dir, stream):
    question = {"role": "user", "content": "Weather in Paris?"}
    kwargs = dict(
        model=MODEL_NAME,
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=64,
    )
    if stream:
        with client.responses.stream(input=[question], **kwargs) as s:
            arg_deltas = [e.delta for e in s if e.type == "response.function_call_arguments.delta"]
            first = s.get_final_response()
    else:
        first = client.responses.create(input=[question], **kwargs)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id and call.status == "completed"
    arguments = json.loads(call.arguments)
    assert arguments["city"] in ("Paris", "Oslo")
    if stream:
        assert "".join(arg_deltas) == call.arguments
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    answer = client.responses.create(
        model=MODEL_NAME,
        input=[question, call, result],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=4,
    )
    assert answer.output[0].type == "message"
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    past_call = {
        "id": call.call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }
    expected = [
        question,
        {"role": "assistant", "content": "", "tool_calls": [past_call]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
    ]
    assert answer.usage.input_tokens == _prompt_tokens(model_dir, expected, tools)


def test_previous_response_id_continues_the_stored_conversation(client, model_dir):
    kwargs = dict(model=MODEL_NAME, temperature=0, max_output_tokens=5)
    first = client.responses.create(input="Hi there", instructions="Old rules.", **kwargs)
    second = client.responses.create(
        input="And then?", previous_response_id=first.id, instructions="New rules.", **kwargs
    )
    # As OpenAI does: the earlier turns carry over, the earlier instructions do not.
    expected = [
        {"role": "system", "content": "New rules."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"},
    ]
    assert second.usage.input_tokens == _prompt_tokens(model_dir, expected)
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(input="x", previous_response_id=first.id, **kwargs)
    assert e.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(input="x", store=False, **kwargs)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize(
    ("fields", "param", "named"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools", "web_search"),
        ({"background": True}, "background", "background"),
        ({"truncation": "auto"}, "truncation", "truncation"),
        ({"reasoning": {"effort": "high"}}, "reasoning", "reasoning"),
        ({"max_tool_calls": 3}, "max_tool_calls", "max_tool_calls"),
        ({"input": []}, "input", "at least 1"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input",
            "input_image",
        ),
        ({"input": [{"type": "web_search_call"}]}, "input", "web_search_call"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "schema"),
        ({"tool_choice": "required"}, "tool_choice", "tools"),
        ({"input": [{"type": "reasoning"}]}, "input", "reasoning items only"),
        ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
        ({"max_output_tokens": 600}, "max_output_tokens", "max_output_tokens=600"),
    ],
)
def test_unsupported_or_bad_fields_are_400_naming_them(client, fields, param, named):
    body = {"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 1, **fields}
    with pytest.raises(openai.BadRequestError) as e:
        client.post("/responses", body=body, cast_to=object)
    assert e.value.body["param"].startswith(param), e.value.body
    assert named in e.value.body["message"]


def _accumulate(events):
    """The events through the openai client's own stream state; its final response."""
    state = ResponseStreamState(input_tools=[], text_format=openai.omit)
    for event in events:
        state.handle_event(_parse_event(event))
    return state._completed_response


def _parse_event(event):
    from openai._models import construct_type
    from openai.types.responses import ResponseStreamEvent

    return construct_type(type_=ResponseStreamEvent, value=json.loads(json.dumps(event)))


def test_reasoning_and_calls_become_items_the_client_accumulates():
    body = ResponsesRequest.model_validate({"input": "x", "tools": [WEATHER]})
    writer = ResponseWriter(new_response(body, "resp_1", "tiny"))
    call = [
        ToolCallDelta(0, "", "call_1", "get_weather"),
        ToolCallDelta(0, '{"city": '),
        ToolCallDelta(0, '"Oslo"}'),
    ]
    events = writer.start()
    for piece in [
        MessagePiece(reasoning="Let me "),
        MessagePiece(reasoning="think.", content="Checking."),
        MessagePiece(tool_calls=call[:2]),
        MessagePiece(tool_calls=call[2:]),
    ]:
        events += writer.feed(piece)
    events += writer.finish("stop", Usage(prompt_tokens=3, completion_tokens=9, total_tokens=12), 4)
    final = _accumulate(events)
    reasoning, message, function_call = final.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Let me think."
    assert message.content[0].text == "Checking." and final.output_text == "Checking."
    assert (function_call.name, function_call.arguments) == ("get_weather", '{"city": "Oslo"}')
    assert final.usage.output_tokens_details.reasoning_tokens == 4
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [
        0,
        1,
        2,
    ]


def test_store_keeps_the_newest_within_its_bounds():
    now = [0.0]
    store = ResponseStore(max_size=2, max_age_s=60, clock=lambda: now[0])
    for i in range(3):
        store.put({"id": f"r{i}"}, [])
    assert store.get("r0") is None and store.get("r2") == ({"id": "r2"}, [])
    now[0] = 61.0
    store.put({"id": "new"}, [])
    assert store.get("r2") is None and store.get("new") == ({"id": "new"}, [])
    assert store.delete("new") and not store.delete("new")
