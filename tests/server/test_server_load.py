"""Concurrency and client disconnects: every request completes or is aborted, no block leaks."""

from __future__ import annotations

import asyncio

import httpx
import openai

from openai_server import API_KEY, MODEL_NAME, SUCCESS


def test_64_concurrent_streams(server):
    before = server.metrics().get(SUCCESS % "length", 0)

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, str | None]:
        stream = await client.completions.create(
            model=MODEL_NAME,
            prompt=f"request {i}: the quick brown fox",
            max_tokens=6,
            temperature=0.8,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        finish, usage = None, None
        async for chunk in stream:
            if chunk.choices:
                finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
        return usage.completion_tokens, finish

    async def main() -> list[tuple[int, str | None]]:
        client = openai.AsyncOpenAI(
            base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0
        )
        async with client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    assert asyncio.run(main()) == [(6, "length")] * 64
    after = server.wait_idle(timeout=2)
    assert after[SUCCESS % "length"] - before == 64


def test_disconnect_aborts_request(server):
    before = server.metrics().get(SUCCESS % "abort", 0)
    body = {"model": MODEL_NAME, "prompt": "Paris", "max_tokens": 400, "stream": True}
    body["ignore_eos"] = True
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream(
        "POST", f"{server.base_url}/v1/completions", json=body, headers=headers, timeout=30
    ) as response:
        chunks = 0
        for line in response.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 3:
                break
    assert server.metrics()["heron:num_requests_running"] <= 1
    after = server.wait_idle(timeout=1)
    assert after[SUCCESS % "abort"] - before == 1
