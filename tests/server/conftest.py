"""The session's server: a `heron serve` subprocess on the tiny qwen2 model."""

from __future__ import annotations

import pytest

from openai_server import API_KEY, start_server, stop_server


@pytest.fixture(scope="session")
def server(tiny_model_dir):
    """A server with an API key; the tests' clients send it."""
    handle = start_server(tiny_model_dir("qwen2"), "--api-key", API_KEY)
    yield handle
    stop_server(handle)
