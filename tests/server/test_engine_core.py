"""The engine core's own process: its death is reported at once, the front's death ends it,
start-up errors reach the command line, requests made once shutdown began fail at once, and a
stop string the front matches stops the core."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
from ports import free_port

from heron.config import EngineConfig
from heron.engine.core_client import EngineCoreClient, EngineDeadError
from heron.engine.messages import AddRequest
from heron.sampling_params import SamplingParams

from openai_server import (
    API_KEY,
    MODEL_NAME,
    SUCCESS,
    child_pids,
    kill_core_during_requests,
    pid_exists,
    start_server,
    stop_server,
)


def _wait_gone(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while pid_exists(pid):
        assert time.monotonic() < deadline, f"process {pid} still runs"
        time.sleep(0.05)


def test_killed_core_fails_the_requests_and_the_server_exits(tiny_model_dir):
    server = start_server(tiny_model_dir("qwen2"), "--api-key", API_KEY)
    try:
        (core,) = child_pids(server.proc.pid)
        kill_core_during_requests(server, core)
    finally:
        stop_server(server)


def test_killed_front_ends_the_core(tiny_model_dir):
    server = start_server(tiny_model_dir("qwen2"))
    try:
        (core,) = child_pids(server.proc.pid)
        # The core's last argument is its CoreArgs, which name the sockets' directory.
        args = Path(f"/proc/{core}/cmdline").read_bytes().split(b"\0")[-2]
        front = json.loads(args)["fronts"][0]
        sockets = Path(front["input_address"].removeprefix("ipc://")).parent
        assert sockets.is_dir()
        server.proc.kill()
        _wait_gone(core, timeout=10)
        assert not sockets.exists()  # nor left its sockets behind
    finally:
        stop_server(server)


@pytest.mark.parametrize("fronts", ["1", "2"])
def test_start_up_error_reaches_the_command_line(tmp_path, fronts):
    """Once, also with several fronts (each of which hears of it)."""
    missing = tmp_path / "no-such-model"
    result = subprocess.run(
        [sys.executable, "-m", "heron.cli", "serve", "--model", str(missing), "--device", "cpu"]
        + ["--api-server-count", fronts, "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    (error,) = [line for line in result.stderr.splitlines() if line.startswith("heron: error:")]
    assert error.startswith("heron: error: the engine could not start:")
    assert str(missing) in result.stderr
    assert "Traceback" not in result.stderr


def test_requests_after_shutdown_get_engine_dead_error(tiny_model_dir):
    """Also the race a signal handler makes: shutdown begun between ``generate``'s check and its
    send, so the request reaches the core after ``Shutdown`` or (here) not at all, the core
    having exited: the send must not wait for it."""
    config = EngineConfig(model=str(tiny_model_dir("qwen2")), device="cpu", num_kv_blocks=64)
    engine = EngineCoreClient(config)
    send = engine._send

    def shutdown_first(message):
        if isinstance(message, AddRequest):
            engine.shutdown(timeout=0)  # as the signal handler does
            _wait_gone(engine.core_pid, timeout=30)
        send(message)

    async def main() -> None:
        engine._send = shutdown_first
        raced = engine.generate("raced", [1, 2, 3], SamplingParams(max_tokens=4))
        with pytest.raises(EngineDeadError, match="shutting down"):
            await asyncio.wait_for(anext(raced), timeout=30)
        late = engine.generate("late", [1, 2, 3], SamplingParams(max_tokens=4))
        with pytest.raises(EngineDeadError, match="shutting down"):
            await anext(late)

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    assert not pid_exists(engine.core_pid)


def test_stop_string_stops_the_core(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)
    prompt, extra = "The quick brown fox", {"ignore_eos": True}
    greedy = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0, extra_body=extra
    )
    text = greedy.choices[0].text
    stop = text[3:5]
    before = server.metrics()
    stopped = client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=400,
        temperature=0,
        stop=[stop],
        n=2,
        extra_body=extra,
    )
    assert [c.finish_reason for c in stopped.choices] == ["stop", "stop"]
    assert [c.text for c in stopped.choices] == [text[: text.index(stop)]] * 2
    # The core was told: it is idle at once, instead of generating the 400 tokens.
    after = server.wait_idle(timeout=1)
    assert after["heron:generation_tokens_total"] - before["heron:generation_tokens_total"] < 20
    assert after.get(SUCCESS % "stop", 0) - before.get(SUCCESS % "stop", 0) == 1


def test_stop_string_of_one_sample_stops_only_it(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)
    request = dict(
        model=MODEL_NAME,
        prompt="Paris is the capital of",
        max_tokens=12,
        temperature=1.0,
        n=2,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    first, second = (c.text for c in client.completions.create(**request).choices)
    stop = next(first[i : i + 2] for i in range(len(first) - 1) if first[i : i + 2] not in second)
    stopped = client.completions.create(**request, stop=[stop]).choices
    assert [(c.finish_reason, c.text) for c in stopped] == [
        ("stop", first[: first.index(stop)]),
        ("length", second),
    ]
