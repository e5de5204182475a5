"""What a web page, an idle connection or a careless client cannot do to a local server:
bodies must be declared JSON, CORS serves only the allowed origins, half-open connections are
dropped, every request has an id and a log line, nulls mean "unset", out-of-range integers and
lax values are 400s naming the field; through the real openai client and raw HTTP, against a
server of this module's own."""

from __future__ import annotations

import re
import socket
import time

import httpx
import openai
import pytest

from openai_server import (
    API_KEY,
    MAX_MODEL_LEN,
    MODEL_NAME,
    openai_client,
    start_server,
    stop_server,
)

GOOD, EVIL = "http://good.example", "http://evil.example"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
HUGE = 2**64  # one past the largest unsigned 64-bit integer


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    handle = start_server(
        tiny_model_dir("qwen2"),
        "--api-key",
        API_KEY,
        "--allowed-origins",
        f'["{GOOD}"]',
        "--timeout-keep-alive",
        "1",
    )
    yield handle
    assert stop_server(handle) == 0
    log = handle.log()
    assert "Traceback" not in log and "Exception in ASGI" not in log, log


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def _error(response: httpx.Response, status: int, param: str | None) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error["message"]


def _wait_for_log(server, pattern: str) -> re.Match:
    """The server log's first match of ``pattern``, once it is written."""
    deadline = time.monotonic() + 30
    while (match := re.search(pattern, server.log())) is None:
        assert time.monotonic() < deadline, f"{pattern!r} not logged:\n{server.log()}"
        time.sleep(0.1)
    return match


COMPLETION = b'{"prompt": "Hi", "max_tokens": 2}'


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize(
    "content_type", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]
)
def test_bodies_not_declared_json_are_415(server, route, content_type):
    """A text/plain POST is what any web page may send without a preflight."""
    headers = {**AUTH, "Origin": EVIL}
    if content_type is not None:
        headers["Content-Type"] = content_type
    response = httpx.post(server.base_url + route, content=COMPLETION, headers=headers)
    message = _error(response, 415, "Content-Type")
    assert "application/json" in message
    assert "access-control-allow-origin" not in response.headers


def test_json_with_parameters_is_json(http):
    headers = {"Content-Type": "application/json; charset=utf-8"}
    response = http.post("/v1/completions", content=COMPLETION, headers=headers)
    assert response.status_code == 200, response.text


def test_cors_answers_the_allowed_origin_only(server):
    preflight = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type",
    }
    url = f"{server.base_url}/v1/completions"
    allowed = httpx.options(url, headers={"Origin": GOOD, **preflight})
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == GOOD
    assert "POST" in allowed.headers["access-control-allow-methods"]
    refused = httpx.options(url, headers={"Origin": EVIL, **preflight})
    assert refused.status_code == 400
    assert "access-control-allow-origin" not in refused.headers
    models = f"{server.base_url}/v1/models"
    assert (
        httpx.get(models, headers={**AUTH, "Origin": GOOD}).headers["access-control-allow-origin"]
        == GOOD
    )
    assert (
        "access-control-allow-origin"
        not in httpx.get(models, headers={**AUTH, "Origin": EVIL}).headers
    )


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"])
def test_connections_without_a_whole_request_head_are_closed(server, sent):
    """A connection that sends nothing, or half a header, is closed by the server (it waits
    here until then; a server that kept it would fail the socket's timeout)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
        s.sendall(sent)
        assert s.recv(1024) == b""
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_request_ids_are_echoed_made_and_logged(server, http):
    given = http.post(
        "/v1/completions",
        json={"prompt": "Hi", "max_tokens": 2},
        headers={"X-Request-Id": "client-id-17"},
    )
    assert given.status_code == 200 and given.headers["x-request-id"] == "client-id-17"
    _wait_for_log(server, r'client-id-17 "POST /v1/completions" 200 \d+ ms')
    made = http.get("/v1/models").headers["x-request-id"]
    assert re.fullmatch("[0-9a-f]{32}", made)
    _wait_for_log(server, rf'{made} "GET /v1/models" 200')
    bad = http.get("/v1/models", headers={"X-Request-Id": "two words"})
    _error(bad, 400, "X-Request-Id")


def test_models_retrieve(client):
    model = client.models.retrieve(MODEL_NAME)
    assert model.id == MODEL_NAME and model.object == "model"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-nope")
    assert e.value.body["code"] == "model_not_found"


# Every nullable field OpenAI's and vLLM's schemas have, set to null: as if not sent.
COMPLETION_NULLS = {
    "n": None,
    "stream": None,
    "stream_options": None,
    "echo": None,
    "best_of": None,
    "logprobs": None,
    "stop": None,
    "seed": None,
    "suffix": None,
    "user": None,
    "logit_bias": None,
    "presence_penalty": None,
    "min_tokens": None,
    "ignore_eos": None,
    "skip_special_tokens": None,
    "include_stop_str_in_output": None,
    "stop_token_ids": None,
    "top_k": None,
    "prompt_logprobs": None,
}
CHAT_NULLS = {
    "n": None,
    "stream": None,
    "logprobs": None,
    "top_logprobs": None,
    "tools": None,
    "tool_choice": None,
    "parallel_tool_calls": None,
    "functions": None,
    "function_call": None,
    "reasoning_effort": None,
    "response_format": None,
    "metadata": None,
    "store": None,
    "min_tokens": None,
    "ignore_eos": None,
    "skip_special_tokens": None,
}


@pytest.mark.parametrize(
    "route, body, nulls",
    [
        ("/v1/completions", {"prompt": "Paris is"}, COMPLETION_NULLS),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, CHAT_NULLS),
    ],
)
def test_null_means_unset(http, route, body, nulls):
    plain = {**body, "max_tokens": 6, "temperature": 0}
    without = http.post(route, json=plain)
    with_nulls = http.post(route, json={**plain, **nulls})
    assert without.status_code == with_nulls.status_code == 200, with_nulls.text
    assert without.json()["choices"] == with_nulls.json()["choices"]


@pytest.mark.parametrize(
    "route, body, param",
    [
        ("/v1/completions", {"prompt": "Hi", "top_k": HUGE}, "top_k"),
        ("/v1/completions", {"prompt": "Hi", "stop_token_ids": [1, HUGE]}, "stop_token_ids"),
        ("/v1/completions", {"prompt": "Hi", "logit_bias": {str(HUGE): 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": HUGE}, "max_tokens"),
        ("/v1/completions", {"prompt": "Hi", "min_tokens": HUGE}, "min_tokens"),
        ("/v1/completions", {"prompt": "Hi", "n": HUGE}, "n"),
        ("/v1/completions", {"prompt": [5, HUGE]}, "prompt"),
        ("/v1/completions", {"prompt": [[5], [6, HUGE]]}, "prompt"),
        ("/detokenize", {"tokens": [5, HUGE]}, "tokens"),
        ("/v1/chat/completions", {"top_k": HUGE}, "top_k"),
    ],
)
def test_integers_out_of_range_are_400_naming_the_field(server, http, route, body, param):
    if route == "/v1/chat/completions":
        body = {"messages": [{"role": "user", "content": "Hi"}], **body}
    _error(http.post(route, json=body), 400, param)
    server.wait_idle(timeout=30)


CHAT = {"messages": [{"role": "user", "content": "Hi"}]}


@pytest.mark.parametrize(
    "route, body, param",
    [
        (
            "/v1/completions",
            {"prompt": "Hi", "stream_options": {"include_usage": True}},
            "stream_options",
        ),
        ("/v1/completions", {"prompt": [True, False]}, "prompt"),
        ("/v1/completions", {"prompt": [1.0, 2.0]}, "prompt"),
        ("/v1/completions", {"prompt": "Hi", "user": 123}, "user"),
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, "max_tokens"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "hacker", "content": "Hi"}]},
            "messages.0.role",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, "messages.0"),
        ("/v1/completions", {"prompt": [5] * MAX_MODEL_LEN, "max_tokens": None}, "prompt"),
    ],
)
def test_lax_values_are_400_naming_the_field(server, http, route, body, param):
    _error(http.post(route, json=body), 400, param)
    server.wait_idle(timeout=30)


def test_a_client_leaving_during_its_upload_is_one_log_line(server):
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Length: 1000\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
        s.sendall(head.encode() + b'{"prompt": ')
    _wait_for_log(server, r"client left POST /v1/completions")
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert "Traceback" not in server.log()
