"""The session's server: a `heron serve` subprocess on the tiny qwen2 model."""

from __future__ import annotations

import httpx
import pytest

from openai_server import API_KEY, openai_client, start_server, stop_server


@pytest.fixture(scope="session")
def server(tiny_model_dir):
    """A server with an API key (the tests' clients send it) and sleep mode on."""
    handle = start_server(
        tiny_model_dir("qwen2"),
        "--api-key",
        API_KEY,
        "--trust-request-chat-template",
        "--enable-sleep-mode",
    )
    yield handle
    stop_server(handle)


@pytest.fixture(scope="session")
def client(server):
    """The official openai client of the session's server."""
    return openai_client(server)


@pytest.fixture(scope="session")
def http(server):
    """Raw HTTP to the session's server, with its API key."""
    with httpx.Client(
        base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
    ) as c:
        yield c
