"""Clients that leave before their first token: their requests are aborted within a second,
while they still wait, and the server logs one line for each, no traceback.

The server runs one sequence at a time, so requests sent behind a long stream wait (the
metrics say so) and are surely left before their first token. It is also the tests' server
without --trust-request-chat-template."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from openai_server import API_KEY, MODEL_NAME, SUCCESS, start_server, stop_server

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def one_seq_server(tiny_model_dir):
    handle = start_server(tiny_model_dir("qwen2"), "--api-key", API_KEY, "--max-num-seqs", "1")
    yield handle
    stop_server(handle)


def _send(server, route: str, body: dict) -> socket.socket:
    """A request over a plain socket, left unanswered; closing the socket is the disconnect."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", server.port))
    head = (
        f"POST {route} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    s.sendall(head.encode() + data)
    return s


def _wait_for(server, predicate, timeout: float) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while not predicate(m := server.metrics()):
        assert time.monotonic() < deadline, f"metrics never matched: {m}"
        time.sleep(0.02)
    return m


def test_requests_left_before_their_first_token_are_aborted(one_seq_server):
    server = one_seq_server
    before = server.metrics()
    long = {"model": MODEL_NAME, "prompt": "Paris", "max_tokens": 450, "stream": True}
    long["ignore_eos"] = True
    with httpx.stream(
        "POST", f"{server.base_url}/v1/completions", json=long, headers=AUTH, timeout=60
    ) as stream:
        lines = stream.iter_lines()
        chunks = sum(line.startswith("data: ") for line in (next(lines), next(lines)))
        waiting = [
            # Non-streaming with three prompts, streaming chat: both wait behind the stream.
            _send(server, "/v1/completions", {"prompt": ["a", "b", "c"], "max_tokens": 5}),
            _send(
                server,
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "hi"}], "stream": True},
            ),
        ]
        _wait_for(server, lambda m: m["heron:num_requests_waiting"] == 4, timeout=30)
        for s in waiting:
            s.close()
        # Within a second, and while the stream still runs, nothing waits any more.
        m = _wait_for(server, lambda m: m["heron:num_requests_waiting"] == 0, timeout=1)
        assert m["heron:num_requests_running"] == 1
        assert m[SUCCESS % "abort"] - before.get(SUCCESS % "abort", 0) == 4
        chunks += sum(line.startswith("data: ") for line in (next(lines), next(lines)))
    after = server.wait_idle(timeout=1)
    assert after[SUCCESS % "abort"] - before.get(SUCCESS % "abort", 0) == 5
    # The stream's tokens count although it was aborted; the waiting ones made none.
    generated = after["heron:generation_tokens_total"] - before["heron:generation_tokens_total"]
    assert generated >= chunks
    log = server.log()
    assert log.count("client left") == 3  # one line per HTTP request
    assert "Traceback" not in log


def test_chat_template_of_a_request_needs_the_operators_consent(one_seq_server):
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 1 }}"}
    response = httpx.post(f"{one_seq_server.base_url}/v1/chat/completions", json=body, headers=AUTH)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "chat_template" and "--trust-request-chat-template" in error["message"]
