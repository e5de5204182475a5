"""``--api-server-count 2``: two front processes on one port and one engine core, through the
official client. Requests from both fronts run at once and each gets its own answer, /metrics
counts every front's requests whichever front is scraped, a tool call streams through a front
(llama3_json), a killed core is seen by both fronts, a dead front stops the server, and SIGTERM
ends the streams and leaves no process behind."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from openai_server import (
    API_KEY,
    MODEL_NAME,
    SUCCESS,
    accumulated_tool_calls,
    child_pids,
    kill_core_during_requests,
    openai_client,
    parse_metrics,
    pid_exists,
    running_stream,
    start_server,
    stop_server,
)

HEADER = "x-heron-api-server"


def _front(base_url: str, path: str = "/health") -> tuple[str, int]:
    """(the answering front's index, status) of a request on a new connection."""
    response = httpx.get(base_url + path, timeout=10)
    return response.headers[HEADER], response.status_code


def _metrics_of(base_url: str, index: str) -> dict[str, float]:
    """/metrics as front ``index`` answers it (new connections until it does)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        response = httpx.get(f"{base_url}/metrics", timeout=10)
        if response.headers[HEADER] == index:
            return parse_metrics(response.text)
    raise AssertionError(f"front {index} did not answer /metrics")


def _both_fronts(base_url: str, path: str = "/health") -> dict[str, int]:
    """The status each front answers ``path`` with: new connections until both have."""
    seen: dict[str, int] = {}
    deadline = time.monotonic() + 30
    while len(seen) < 2:
        assert time.monotonic() < deadline, f"only fronts {seen} answered"
        index, status = _front(base_url, path)
        seen[index] = status
    return seen


@pytest.fixture(scope="module")
def fronts_server(tiny_model_dir):
    flags = ["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"]
    handle = start_server(
        tiny_model_dir("qwen2"), "--api-key", API_KEY, "--api-server-count", "2", *flags
    )
    assert _both_fronts(handle.base_url) == {"0": 200, "1": 200}
    yield handle
    stop_server(handle)


def _complete(base_url: str, prompt: str) -> tuple[str, str, str]:
    """(front, prompt, text) of a greedy completion on a client (connection) of its own."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0)
    raw = client.completions.with_raw_response.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    completion = raw.parse()
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 12
    return raw.headers[HEADER], prompt, completion.choices[0].text


def test_concurrent_requests_on_both_fronts_each_get_their_answer(fronts_server):
    url = fronts_server.base_url
    prompts = ["Paris is", "The quick brown fox", "Numbers: 0 1 2", "def add(a, b):"]
    alone = {p: _complete(url, p)[2] for p in prompts}  # the reference: one at a time
    before = fronts_server.metrics()
    # Rounds of 16 at once until both fronts have answered: the fronts share one listening
    # socket, and on a loaded machine one of them may accept a whole round.
    results = []
    with ThreadPoolExecutor(16) as pool:
        for _ in range(4):
            results += pool.map(lambda i: _complete(url, prompts[i % 4]), range(16))
            if {front for front, _, _ in results} == {"0", "1"}:
                break
    assert {front for front, _, _ in results} == {"0", "1"}
    assert all(text == alone[prompt] for _, prompt, text in results)
    # Any front's scrape counts both fronts' requests.
    key = SUCCESS % "length"
    for index in "01":
        after = _metrics_of(url, index)
        assert after[key] - before[key] == len(results)
        generated = after["heron:generation_tokens_total"] - before["heron:generation_tokens_total"]
        assert generated == len(results) * 12


def test_a_tool_call_streams_through_a_front(fronts_server):
    reply = r'\{"name": "get_time", "parameters": \{"zone": "(utc|cet)"\}\}'
    stream = openai_client(fronts_server).chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "What time is it?"}],
        tools=[{"type": "function", "function": {"name": "get_time"}}],
        max_tokens=64,
        stream=True,
        extra_body={"structured_outputs": {"regex": reply}},
    )
    choice, pieces = accumulated_tool_calls(stream)
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and call.function.name == "get_time"
    assert json.loads(call.function.arguments)["zone"] in ("utc", "cet")
    assert len(pieces[0]) > 1


def _processes(server) -> tuple[int, list[int], Path]:
    """The server's core and fronts, and the directory of their sockets."""
    cmdlines = {
        pid: Path(f"/proc/{pid}/cmdline").read_bytes() for pid in child_pids(server.proc.pid)
    }
    (core,) = [pid for pid, cmd in cmdlines.items() if b"heron.engine.core_process" in cmd]
    fronts = [pid for pid, cmd in cmdlines.items() if b"heron.server.api_server" in cmd]
    assert len(fronts) == 2
    front = json.loads(cmdlines[core].split(b"\0")[-2])["fronts"][0]
    sockets = Path(front["input_address"].removeprefix("ipc://")).parent
    assert sockets.is_dir()
    return core, fronts, sockets


def _all_gone(pids: list[int], sockets: Path) -> None:
    assert not [pid for pid in pids if pid_exists(pid)]
    assert not sockets.exists()


def test_killed_core_makes_every_front_exit(tiny_model_dir):
    server = start_server(tiny_model_dir("qwen2"), "--api-key", API_KEY, "--api-server-count", "2")
    try:
        _both_fronts(server.base_url)
        core, fronts, sockets = _processes(server)
        kill_core_during_requests(server, core)
    finally:
        stop_server(server)
    _all_gone([core, *fronts], sockets)
    assert server.log().count("the engine core is gone; this API server shuts down") == 2


def test_sigterm_ends_the_streams_and_leaves_nothing(fronts_server):
    """Last in this module: it stops the module's server, whose core runs."""
    core, fronts, sockets = _processes(fronts_server)
    chunks = running_stream(openai_client(fronts_server))
    fronts_server.proc.terminate()
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "abort"
    assert fronts_server.proc.wait(timeout=60) == 0
    _all_gone([core, *fronts], sockets)
    log = fronts_server.log()
    assert "Traceback" not in log and "Fatal Python error" not in log
