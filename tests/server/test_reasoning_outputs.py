"""A reasoning model's replies through the official client: ``--reasoning-parser deepseek_r1``
splits the think block from the content, and a grammar constrains only the content, as in
vLLM. The tiny random model has ``<think>`` and ``</think>`` as tokens and a template that opens
the block (as DeepSeek-R1's does); a logit bias on ``</think>`` ends its reasoning after a few
free tokens (past it the grammar masks ``</think>``, and a bias never lifts a masked token)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from transformers import AutoTokenizer

from json_schemas import SCHEMAS
from openai_server import API_KEY, MODEL_NAME, openai_client, start_server, stop_server
from tiny_models import CHAT_TEMPLATE, save_tiny_model

MESSAGES = [{"role": "user", "content": "Describe a record."}]
THINK_END_BIAS = 6


@pytest.fixture(scope="module")
def reasoning_server(tmp_path_factory):
    model_dir = save_tiny_model(
        "qwen2", tmp_path_factory.mktemp("reasoning-model"), added_tokens=("<think>", "</think>")
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = CHAT_TEMPLATE.replace("<|assistant|>", "<|assistant|><think>")
    tokenizer.save_pretrained(model_dir)
    handle = start_server(model_dir, "--api-key", API_KEY, "--reasoning-parser", "deepseek_r1")
    handle.think_end = tokenizer.convert_tokens_to_ids("</think>")
    yield handle
    stop_server(handle)


@pytest.fixture(scope="module")
def reasoning_client(reasoning_server):
    return openai_client(reasoning_server)


def _chat(server, client, **kwargs):
    bias = {str(server.think_end): THINK_END_BIAS}
    return client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, temperature=1.0, logit_bias=bias, **kwargs
    )


def test_json_schema_applies_after_the_reasoning(reasoning_server, reasoning_client):
    schema = SCHEMAS[0]
    response = _chat(
        reasoning_server,
        reasoning_client,
        n=6,
        seed=11,
        max_tokens=128,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "record", "schema": schema, "strict": True},
        },
    )
    reasonings = []
    for choice in response.choices:
        message = choice.message
        assert choice.finish_reason == "stop", message
        jsonschema.validate(json.loads(message.content), schema)
        assert "</think>" not in message.content
        reasonings.append(message.reasoning_content or "")
    # Free text: a grammar applied from the first token would have opened the JSON there.
    free = [r for r in reasonings if r.strip() and not r.lstrip().startswith("{")]
    assert len(free) >= 3, reasonings


def test_reasoning_and_constrained_content_streamed_and_not(reasoning_server, reasoning_client):
    kwargs = dict(
        seed=4, max_tokens=64, extra_body={"structured_outputs": {"regex": r"[A-Z][a-z]{1,8}\."}}
    )
    (choice,) = _chat(reasoning_server, reasoning_client, **kwargs).choices
    message = choice.message
    assert re.fullmatch(r"[A-Z][a-z]{1,8}\.", message.content)
    assert message.reasoning_content and "<think>" not in message.reasoning_content
    reasoning, content = "", ""
    for chunk in _chat(reasoning_server, reasoning_client, stream=True, **kwargs):
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
    assert (reasoning, content) == (message.reasoning_content, message.content)


def test_responses_reasoning_items_equal_the_chat_reasoning(reasoning_client):
    """``/v1/responses`` splits the reply as chat does: a reasoning item, then the message."""
    (choice,) = reasoning_client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, temperature=0, max_tokens=24
    ).choices
    kwargs = dict(model=MODEL_NAME, input=MESSAGES, temperature=0, max_output_tokens=24)
    response = reasoning_client.responses.create(**kwargs)
    reasoning, *rest = response.output
    assert reasoning.type == "reasoning"
    assert reasoning.content[0].text == choice.message.reasoning_content
    assert response.output_text == (choice.message.content or "")
    details = response.usage.output_tokens_details
    if choice.message.content:  # </think> came: some tokens are the answer's
        assert 0 < details.reasoning_tokens < response.usage.output_tokens
    else:
        assert details.reasoning_tokens == response.usage.output_tokens
    with reasoning_client.responses.stream(**kwargs) as stream:
        events = list(stream)
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == reasoning.content[0].text
