"""Starting and stopping a `heron serve` subprocess on a free loopback port for tests."""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from ports import free_port

API_KEY = "test-key"
MODEL_NAME = "tiny"
# Long enough that an unbounded stream outlives the disconnect and shutdown tests' checks.
MAX_MODEL_LEN = 512
NUM_KV_BLOCKS = 400
SUCCESS = 'heron:request_success_total{finished_reason="%s"}'


@dataclass
class ServerHandle:
    proc: subprocess.Popen
    port: int
    model_dir: Path
    log_path: Path  # the server's stdout and stderr (a file: a pipe nobody reads fills up)

    def log(self) -> str:
        return self.log_path.read_text()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metrics(self) -> dict[str, float]:
        """The /metrics samples, keyed by name plus labels as exported."""
        return parse_metrics(httpx.get(f"{self.base_url}/metrics").text)

    def wait_idle(self, timeout: float) -> dict[str, float]:
        """Metrics once no request runs and every KV block is free again (or fail after
        ``timeout``)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (
                m["heron:num_requests_running"] == 0
                and m["heron:num_requests_waiting"] == 0
                and m["heron:kv_cache_usage_perc"] == 0
                and m["heron:kv_cache_free_blocks"] == m["heron:kv_cache_total_blocks"]
            )
            if idle:
                return m
            assert time.monotonic() < deadline, f"engine not idle: {m}"
            time.sleep(0.05)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text's heron samples, keyed by name plus labels as exported."""
    samples = {}
    for line in text.splitlines():
        match = re.match(r"^(heron:\S+?)\s+(\S+)$", line)
        if match:
            samples[match[1]] = float(match[2])
    return samples


def openai_client(handle: ServerHandle) -> openai.OpenAI:
    """The official openai client of a test server, with the tests' API key."""
    return openai.OpenAI(base_url=f"{handle.base_url}/v1", api_key=API_KEY, max_retries=0)


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (a server's engine core), from /proc."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # "pid (comm) state ppid ...": comm may hold spaces, so split after its ")".
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue  # exited meanwhile
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


def pid_exists(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as gone: it has exited)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def start_server(model_dir: Path, *extra: str, startup_s: float = 90) -> ServerHandle:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "heron.cli",
        "--log-level",
        "INFO",
        "serve",
        str(model_dir),  # positional, as `vllm serve MODEL`
        "--port",
        str(port),
        "--served-model-name",
        MODEL_NAME,
        "--device",
        "cpu",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--num-kv-blocks",
        str(NUM_KV_BLOCKS),
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    log_path = Path(tempfile.mkstemp(prefix="heron-serve-", suffix=".log")[1])
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    handle = ServerHandle(proc, port, model_dir, log_path)
    deadline = time.monotonic() + startup_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early:\n{handle.log()}")
        try:
            if httpx.get(f"{handle.base_url}/health", timeout=1).status_code == 200:
                return handle
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not become healthy")


def stop_server(handle: ServerHandle) -> int:
    if handle.proc.poll() is None:
        handle.proc.terminate()
    try:
        return handle.proc.wait(timeout=30)
    finally:
        if handle.proc.poll() is None:
            handle.proc.kill()


def accumulated_tool_calls(stream) -> tuple[object, dict[int, list]]:
    """A streamed chat reply's first choice as the openai client accumulates it
    (``ChatCompletionStreamState``), and each tool call's pieces as sent, checked against
    OpenAI's delta schema: the first piece has the id, type and name, the next ones only
    arguments."""
    from openai.lib.streaming.chat import ChatCompletionStreamState

    state, pieces = ChatCompletionStreamState(), {}
    for chunk in stream:
        state.handle_chunk(chunk)
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                pieces.setdefault(call.index, []).append(call)
    for first, *rest in pieces.values():
        assert first.id.startswith("call_") and first.type == "function" and first.function.name
        assert all(p.id is None and p.type is None and p.function.name is None for p in rest)
        assert all(p.function.arguments for p in rest)
    return state.get_final_completion().choices[0], pieces


def running_stream(client: openai.OpenAI):
    """The chunks of a long completion stream whose first chunk has arrived."""
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt="Paris",
        max_tokens=450,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    next(chunks)
    return chunks


def kill_core_during_requests(server: ServerHandle, core_pid: int) -> None:
    """Kill the engine core while a stream and a whole completion run: both fail naming the
    core's death (the whole one with 503), and the server exits with status 1, so that a
    supervisor restarts the service."""
    client = openai_client(server)
    chunks = running_stream(client)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        whole = pool.submit(
            client.completions.create,
            model=MODEL_NAME,
            prompt="Paris",
            max_tokens=450,
            extra_body={"ignore_eos": True},
        )
        deadline = time.monotonic() + 30
        while server.metrics()["heron:num_requests_running"] < 2:
            assert time.monotonic() < deadline, "the whole completion did not start"
            time.sleep(0.05)
        os.kill(core_pid, signal.SIGKILL)
        received = 0
        # The stream fails on the core's death (a client timeout would raise APITimeoutError,
        # whose message differs), long before its 450 tokens could have been produced.
        with pytest.raises(openai.APIError, match="engine core process died"):
            for _ in chunks:
                received += 1
        assert received < 449
        with pytest.raises(openai.InternalServerError, match="engine core process died") as e:
            whole.result()
    assert e.value.status_code == 503
    assert server.proc.wait(timeout=30) == 1
    assert "the engine core is gone; this API server shuts down" in server.log()
