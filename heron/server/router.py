"""``heron router``: an OpenAI-compatible proxy in front of prefill and decode instances.

Each completion or chat request goes first to a prefill instance (``max_tokens`` 1, not
streamed, ``kv_transfer_params: {"do_remote_decode": true}``), whose answer's
``kv_transfer_params`` say where the prompt's KV blocks are; then, as the client sent it
with those parameters, to a decode instance, whose answer (streamed or not) is the client's.
Instances of each role are picked by least outstanding requests; a prefill instance that
fails (unreachable, or a 5xx answer) is replaced by the next one. A client that disconnects
while the prefill instance computes closes that request, which aborts it there; later, it
closes the decode instance's stream, which aborts the request there (and a decode instance
that aborts a request before reading its blocks tells the prefill instance to free them).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator, Sequence

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from heron.server.disconnect import ClientDisconnected, until_disconnect

logger = logging.getLogger(__name__)

# Request headers passed on to the instances (the rest are the proxy's own connection's).
_FORWARDED_HEADERS = ("authorization", "content-type")


class Instances:
    """Instances of one role, picked by their outstanding requests (fewest first)."""

    def __init__(self, role: str, urls: Sequence[str]) -> None:
        if not urls:
            raise ValueError(f"--{role}: give at least one instance URL")
        self.role = role
        self.outstanding = {url.rstrip("/"): 0 for url in urls}

    def by_load(self) -> list[str]:
        """Every instance, least loaded first (the order given breaks ties)."""
        return sorted(self.outstanding, key=self.outstanding.__getitem__)

    def acquire(self, url: str) -> None:
        self.outstanding[url] += 1

    def release(self, url: str) -> None:
        self.outstanding[url] -= 1

    @contextlib.contextmanager
    def use(self, url: str):
        self.acquire(url)
        try:
            yield url
        finally:
            self.release(url)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "router_error", "param": None, "code": status}},
        status_code=status,
    )


def make_app(prefill_urls: Sequence[str], decode_urls: Sequence[str]) -> FastAPI:
    prefills, decodes = Instances("prefill", prefill_urls), Instances("decode", decode_urls)
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0))

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        await client.aclose()

    app = FastAPI(title="heron router", lifespan=lifespan)

    async def prefill(path: str, body: dict, headers: dict) -> dict | Response:
        """The kv_transfer_params of the first prefill instance that answers (or the error
        response to return: a client error, or every instance failing)."""
        body = {**body, "max_tokens": 1, "stream": False, "n": 1}
        body["kv_transfer_params"] = {"do_remote_decode": True}
        for name in ("max_completion_tokens", "stream_options"):
            body.pop(name, None)
        failures = []
        for url in prefills.by_load():
            with prefills.use(url):
                try:
                    answer = await client.post(f"{url}{path}", json=body, headers=headers)
                except httpx.TransportError as e:
                    failures.append(f"{url}: {e!r}")
                    continue
            if answer.status_code >= 500:
                failures.append(f"{url}: {answer.status_code} {answer.text[:200]}")
                continue
            if answer.status_code != 200:
                return Response(answer.content, answer.status_code, media_type="application/json")
            params = answer.json().get("kv_transfer_params")
            if params is None:
                failures.append(f"{url}: no kv_transfer_params (not a prefill instance?)")
                continue
            return params
        logger.warning("every prefill instance failed: %s", "; ".join(failures))
        return _error(502, f"every prefill instance failed: {'; '.join(failures)}")

    async def proxy(request: Request, path: str) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError:
            return _error(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the request body is not a JSON object")
        headers = {k: v for k, v in request.headers.items() if k in _FORWARDED_HEADERS}
        try:
            params = await until_disconnect(request, prefill(path, body, headers))
        except ClientDisconnected:  # (nobody reads the answer)
            logger.info("client left during the prefill; its request there was aborted")
            return Response(status_code=499)
        if isinstance(params, Response):
            return params
        body["kv_transfer_params"] = params
        url = decodes.by_load()[0]
        decodes.acquire(url)
        try:
            upstream = await client.send(
                client.build_request("POST", f"{url}{path}", json=body, headers=headers),
                stream=True,
            )
        except httpx.TransportError as e:
            decodes.release(url)
            return _error(502, f"decode instance {url}: {e!r}")

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:  # (also when the client disconnected: the decode side then aborts)
                await upstream.aclose()
                decodes.release(url)

        return StreamingResponse(
            relay(),
            upstream.status_code,
            media_type=upstream.headers.get("content-type"),
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxy(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k in _FORWARDED_HEADERS}
        url = decodes.by_load()[0]
        try:
            answer = await client.get(f"{url}/v1/models", headers=headers)
        except httpx.TransportError as e:
            return _error(502, f"decode instance {url}: {e!r}")
        return Response(answer.content, answer.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    return app


def run_router(
    prefill_urls: Sequence[str], decode_urls: Sequence[str], host: str, port: int
) -> int:
    import uvicorn

    uvicorn.run(make_app(prefill_urls, decode_urls), host=host, port=port, log_level="warning")
    return 0
