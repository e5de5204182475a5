"""Benchmark a running ``heron serve``: N streaming completions at a rate or a concurrency.

    python benchmarks/serve.py --num-requests 16 --concurrency 4 --max-tokens 64
    python benchmarks/serve.py --num-requests 64 --request-rate 8

Prints a markdown table of throughput and TTFT / inter-token latency percentiles.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx

PROMPTS = [
    "Explain how a paged key-value cache works.",
    "Write a short poem about herons.",
    "What is the capital of France, and why is it famous?",
    "List three uses of continuous batching in LLM serving.",
]


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    error: str = ""


async def one_request(
    client: httpx.AsyncClient, url: str, model: str | None, prompt: str, max_tokens: int
) -> Result:
    """Stream one completion; token times are the arrival times of content chunks."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,  # every request produces max_tokens, so runs are comparable
    }
    start = time.perf_counter()
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
                times.append(time.perf_counter())
    if not times:
        return Result(False, error="no tokens")
    itls = [b - a for a, b in zip(times, times[1:])]
    return Result(True, times[0] - start, times[-1] - start, itls, tokens)


def percentiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        v = values[0] if values else float("nan")
        return v, v, v
    q = statistics.quantiles(values, n=100, method="inclusive")
    return q[49], q[89], q[98]


async def measure(
    base_url: str,
    api_key: str | None,
    model: str | None,
    num_requests: int,
    concurrency: int | None,
    max_tokens: int,
    request_rate: float | None = None,
) -> tuple[list[Result], float]:
    """Run the requests; return their results and the wall time they took."""
    url = f"{base_url}/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = asyncio.Semaphore(concurrency or num_requests)
    rng = random.Random(0)

    async def limited(client: httpx.AsyncClient, i: int) -> Result:
        async with limit:
            return await one_request(client, url, model, PROMPTS[i % len(PROMPTS)], max_tokens)

    # httpx pools 100 connections by default: more streams would queue in the client.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=600, headers=headers, limits=limits) as client:
        start = time.perf_counter()
        tasks = []
        for i in range(num_requests):
            tasks.append(asyncio.create_task(limited(client, i)))
            if request_rate:  # Poisson arrivals
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


async def run(args: argparse.Namespace) -> None:
    results, elapsed = await measure(
        args.base_url,
        args.api_key,
        args.model,
        args.num_requests,
        args.concurrency,
        args.max_tokens,
        args.request_rate,
    )
    ok = [r for r in results if r.ok]
    for r in results:
        if not r.ok:
            print(f"failed request: {r.error}")
    tokens = sum(r.completion_tokens for r in ok)
    ttft = percentiles([r.ttft for r in ok])
    itl = percentiles([x for r in ok for x in r.itls])
    e2e = percentiles([r.latency for r in ok])
    load = f"rate {args.request_rate}/s" if args.request_rate else f"concurrency {args.concurrency}"
    print(f"\n{len(ok)}/{len(results)} requests ok, {load}, max_tokens {args.max_tokens}\n")
    print("| metric | value |")
    print("|---|---|")
    print(f"| duration (s) | {elapsed:.2f} |")
    print(f"| requests/s | {len(ok) / elapsed:.2f} |")
    print(f"| output tokens/s | {tokens / elapsed:.1f} |")
    for name, (p50, p90, p99) in (("TTFT", ttft), ("ITL", itl), ("e2e latency", e2e)):
        print(
            f"| {name} p50 / p90 / p99 (ms) | {p50 * 1e3:.1f} / {p90 * 1e3:.1f} / {p99 * 1e3:.1f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="model name (default: the server's)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=4, help="most requests in flight")
    parser.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="requests/s (Poisson); default: all at once",
    )
    args = parser.parse_args()
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
