"""``heron bench serve``: streaming completions against a running ``heron serve`` (or one it
starts), at each of several concurrencies: output tokens/s, TTFT, inter-token latency and
end-to-end latency percentiles.

Each point runs ``--rounds`` x concurrency requests (temperature 0, ``ignore_eos``, so every
request produces ``--max-tokens`` tokens and runs compare), ``concurrency`` in flight at once
or, with ``--request-rate``, arriving as a Poisson process. The client is spread over several
processes so that its own parsing does not cap what a fast server can show. Token times are
the arrival times of content chunks. Without ``--base-url`` the server is started from this
source tree with ``--server-arg`` passed to ``heron serve`` (with ``--shape``, on that shape's
random weights), and stopped at the end; with ``--pd``, a prefill and a decode instance (the
nixl connector) behind ``heron router``. ``--prompt-tokens`` sends prompts of that many
random token ids (long prompts, whatever the tokenizer) instead of the short texts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from heron.bench.measure import percentiles
from heron.bench.result import Metric
from heron.bench.shapes import dummy_checkpoint, shape

PROMPTS = [
    "Explain how a paged key-value cache works.",
    "Write a short poem about herons.",
    "What is the capital of France, and why is it famous?",
    "List three uses of continuous batching in LLM serving.",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default=None, help="a running server (default: start one)")
    parser.add_argument("--port", type=int, default=8321, help="of the server started")
    parser.add_argument(
        "--server-arg", action="append", default=[], help="passed to the heron serve started"
    )
    parser.add_argument(
        "--model-name", default=None, help="the API's model (default: the server's)"
    )
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--rounds", type=int, default=2, help="requests per stream slot")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--request-rate", type=float, default=None, help="requests/s (Poisson)")
    parser.add_argument("--client-processes", type=int, default=8)
    parser.add_argument(
        "--pd",
        action="store_true",
        help="start a prefill and a decode instance (the nixl connector; on --port + 1 and "
        "+ 2) behind `heron router` on --port instead of one instance",
    )
    parser.add_argument(
        "--kv-transfer-mode",
        choices=("layerwise", "whole"),
        default=None,
        help="with --pd: how the prompt's KV moves (default: the connector's for the model)",
    )
    parser.add_argument(
        "--shape", default=None, help="the servers started serve this shape's random weights"
    )
    parser.add_argument(
        "--prompt-tokens", type=int, default=None, help="prompts of this many random token ids"
    )


@dataclass
class Result:
    ok: bool
    start: float = 0.0  # time.monotonic() at the request's start: one clock for all processes
    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    error: str = ""


async def one_request(
    client, url: str, model: str | None, prompt: str | list[int], max_tokens: int
) -> Result:
    """Stream one completion."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    start = time.monotonic()
    times: list[float] = []
    tokens = 0
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            return Result(False, error=(await response.aread()).decode()[:200])
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0]["text"]:
                times.append(time.monotonic())
    if not times:
        return Result(False, error="no tokens")
    itls = [b - a for a, b in zip(times, times[1:])]
    return Result(True, start, times[0] - start, times[-1] - start, itls, tokens)


async def requests(
    args: dict[str, Any], num_requests: int, concurrency: int, seed: int
) -> list[Result]:
    import httpx

    url = f"{args['base_url']}/v1/completions"
    headers = {"Authorization": f"Bearer {args['api_key']}"} if args["api_key"] else {}
    limit = asyncio.Semaphore(concurrency)
    rng = random.Random(seed)

    async def limited(client, i: int) -> Result:
        async with limit:
            if args["prompt_tokens"]:  # ids past the special tokens of any tokenizer
                prompt = [rng.randrange(1000, 10000) for _ in range(args["prompt_tokens"])]
            else:
                prompt = PROMPTS[i % len(PROMPTS)]
            return await one_request(client, url, args["model_name"], prompt, args["max_tokens"])

    # httpx pools 100 connections by default: more streams would queue in the client.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=600, headers=headers, limits=limits) as client:
        tasks = []
        for i in range(num_requests):
            tasks.append(asyncio.create_task(limited(client, i)))
            if args["request_rate"]:
                await asyncio.sleep(rng.expovariate(args["request_rate"] / args["processes"]))
        return list(await asyncio.gather(*tasks))


def _client(
    args: dict[str, Any], num_requests: int, concurrency: int, seed: int
) -> tuple[float, float, list[Result]]:
    """One client process's share: (start, end, results), monotonic times."""
    start = time.monotonic()
    results = asyncio.run(requests(args, num_requests, concurrency, seed))
    return start, time.monotonic(), results


def workload(args: dict[str, Any], concurrency: int) -> str:
    """What a point's figures were measured under, for their names."""
    parts = [f"concurrency {concurrency}"]
    if args["prompt_tokens"]:
        parts.append(f"{args['prompt_tokens']}-token prompts")
    if args["request_rate"]:
        parts.append(f"{args['request_rate']:g} req/s")
    if args["pd"]:
        parts.append(" ".join(filter(None, ["1 prefill + 1 decode", args["kv_transfer_mode"]])))
    return ", ".join(parts)


def point(
    pool: ProcessPoolExecutor, args: dict[str, Any], concurrency: int, rounds: int
) -> list[Metric]:
    """One concurrency's figures (named for ``args``' setup: one instance, or PD)."""
    processes = min(args["processes"], concurrency)
    shares = [concurrency // processes + (i < concurrency % processes) for i in range(processes)]
    futures = [pool.submit(_client, args, rounds * s, s, i) for i, s in enumerate(shares)]
    parts = [f.result() for f in futures]
    results = [r for _, _, rs in parts for r in rs]
    elapsed = max(end for _, end, _ in parts) - min(start for start, _, _ in parts)
    ok = [r for r in results if r.ok]
    for r in results:
        if not r.ok:
            print(f"failed request: {r.error}", file=sys.stderr)
    tokens = sum(r.completion_tokens for r in ok)
    at = workload(args, concurrency)
    metrics = [
        Metric(f"output tok/s, {at}", tokens / elapsed, "tok/s"),
        Metric(f"requests/s, {at}", len(ok) / elapsed, "req/s"),
        Metric(f"failed requests, {at}", len(results) - len(ok), "requests"),
    ]
    for name, values in (
        ("TTFT", [r.ttft for r in ok]),
        ("ITL", [x for r in ok for x in r.itls]),
        ("e2e latency", [r.latency for r in ok]),
    ):
        for q, v in zip(("p50", "p90", "p99"), percentiles(values)):
            metrics.append(Metric(f"{name} {q}, {at}", v * 1e3, "ms"))
    return metrics


def start_server(port: int, server_args: list[str], command: str = "serve") -> subprocess.Popen:
    """``heron COMMAND`` (serve, router) from this source tree, once healthy on ``port``."""
    import httpx

    source = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(source), os.environ.get("PYTHONPATH")])),
    }
    cmd = [sys.executable, "-m", "heron.cli", command, "--port", str(port), *server_args]
    proc = subprocess.Popen(cmd, env=env)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"heron {command} exited with code {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"heron {command} did not become healthy in 900 s")


def start_pd(port: int, server_args: list[str], mode: str | None = None) -> list[subprocess.Popen]:
    """A prefill and a decode instance on ``port`` + 1 and + 2, ``heron router`` on ``port``;
    ``mode``: their ``kv_transfer_mode`` (None: the connector's default)."""
    extra = {} if mode is None else {"kv_transfer_mode": mode}
    procs = []
    try:
        for offset, role in ((1, "prefill"), (2, "decode")):
            config = json.dumps(
                {"kv_connector": "nixl", "kv_role": role, "kv_connector_extra_config": extra}
            )
            procs.append(
                start_server(port + offset, [*server_args, "--kv-transfer-config", config])
            )
        urls = [f"http://127.0.0.1:{port + offset}" for offset in (1, 2)]
        procs.append(
            start_server(port, ["--prefill", urls[0], "--decode", urls[1]], command="router")
        )
    except BaseException:
        _stop(procs)
        raise
    return procs


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in reversed(procs):
        proc.terminate()
        proc.wait(60)


def run(args: argparse.Namespace, config: Any = None) -> tuple[dict[str, Any], list[Metric]]:
    for started in ("pd", "shape"):
        if getattr(args, started) and args.base_url:
            raise ValueError(f"--{started} is for the servers started here: give no --base-url")
    with contextlib.ExitStack() as stack:
        server_args = list(args.server_arg)
        if args.shape:
            path = stack.enter_context(dummy_checkpoint(shape(args.shape)))
            server_args = [path, "--load-format", "dummy", *server_args]
        return _measure(args, server_args)


def _measure(args: argparse.Namespace, server_args: list[str]) -> tuple[dict, list[Metric]]:
    if args.base_url:
        procs = []
    elif args.pd:
        procs = start_pd(args.port, server_args, args.kv_transfer_mode)
    else:
        procs = [start_server(args.port, server_args)]
    client = {
        "base_url": args.base_url or f"http://127.0.0.1:{args.port}",
        "api_key": args.api_key,
        "model_name": args.model_name,
        "max_tokens": args.max_tokens,
        "request_rate": args.request_rate,
        "processes": args.client_processes,
        "pd": args.pd,
        "kv_transfer_mode": args.kv_transfer_mode,
        "prompt_tokens": args.prompt_tokens,
    }
    metrics: list[Metric] = []
    try:
        with ProcessPoolExecutor(args.client_processes) as pool:
            point(pool, client | {"max_tokens": 16}, min(16, max(args.concurrency)), 1)  # warm-up
            for concurrency in args.concurrency:
                metrics += point(pool, client, concurrency, args.rounds)
    finally:
        _stop(procs)
    keys = (
        "base_url",
        "server_arg",
        "concurrency",
        "rounds",
        "max_tokens",
        "request_rate",
        "client_processes",
        "pd",
        "kv_transfer_mode",
        "shape",
        "prompt_tokens",
    )
    return {k: getattr(args, k) for k in keys}, metrics
