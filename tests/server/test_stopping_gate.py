"""The shutdown gate of `heron serve`: once the signal came, every new request gets 503 at once
(the engine behind it is stopping), lifespan events still pass."""

from __future__ import annotations

import asyncio

import httpx
from starlette.responses import PlainTextResponse

from heron.server.front import _RefuseWhileStopping


def test_requests_after_the_signal_get_503():
    seen = []

    async def app(scope, receive, send):
        seen.append(scope["type"])
        if scope["type"] == "http":
            await PlainTextResponse("served")(scope, receive, send)

    gate = _RefuseWhileStopping(app)

    async def main() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=gate)
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            before = await client.get("/health")
            gate.stopping = True
            after = await client.post("/v1/completions", json={"prompt": "hi"})
            await gate({"type": "lifespan"}, None, None)
            return [before, after]

    before, after = asyncio.run(main())
    assert before.text == "served"
    assert after.status_code == 503
    assert after.json()["error"]["type"] == "service_unavailable_error"
    assert seen == ["http", "lifespan"]
