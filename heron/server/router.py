"""``heron router``: an OpenAI-compatible proxy in front of prefill and decode instances.

Each completion or chat request first asks a prefill instance for its handshake
(``GET /kv_transfer``), which names how the KV moves (``kv_transfer_mode``):

``layerwise``: the request goes to that prefill instance (``max_tokens`` 1, not streamed,
``kv_transfer_params: {"do_remote_decode": true, "transfer_id": ...}``) and, at once, as the
client sent it with the same transfer id and the handshake, to a decode instance, whose answer
(streamed or not) is the client's: the decode instance tells the prefill instance where the
blocks go, and the prefill instance writes each layer as it computes it.

``whole``: the request goes first to the prefill instance (as above, without a transfer id),
whose answer's ``kv_transfer_params`` say where the prompt's KV blocks are; then, as the client
sent it with those parameters, to a decode instance, which reads them.

Instances of each role are picked by least outstanding requests; a prefill instance that
fails (unreachable, or a 5xx answer) before the decode instance is asked is replaced by the
next one. A client that disconnects closes the requests in flight, which aborts them there
(and a decode instance that aborts a request before its transfer started tells the prefill
instance so).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
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

    async def handshake(headers: dict) -> tuple[str, dict] | Response:
        """The first prefill instance that answers ``GET /kv_transfer``, and its answer (or
        the error response to return: every instance failing)."""
        failures = []
        for url in prefills.by_load():
            try:
                answer = await client.get(f"{url}/kv_transfer", headers=headers)
            except httpx.TransportError as e:
                failures.append(f"{url}: {e!r}")
                continue
            if answer.status_code == 200:
                return url, answer.json()
            if answer.status_code < 500 and answer.status_code != 404:
                return Response(answer.content, answer.status_code, media_type="application/json")
            failures.append(f"{url}: {answer.status_code} {answer.text[:200]}")
        logger.warning("every prefill instance failed: %s", "; ".join(failures))
        return _error(502, f"every prefill instance failed: {'; '.join(failures)}")

    def prefill_body(body: dict, params: dict) -> dict:
        """What a prefill instance computes: the prompt and one token."""
        body = {**body, "max_tokens": 1, "stream": False, "n": 1, "kv_transfer_params": params}
        for name in ("max_completion_tokens", "stream_options"):
            body.pop(name, None)
        return body

    async def prefill(path: str, body: dict, headers: dict, first: str) -> dict | Response:
        """The kv_transfer_params of the first prefill instance (``first``, then the others)
        that answers (or the error response to return: a client error, or every instance
        failing)."""
        body = prefill_body(body, {"do_remote_decode": True})
        failures = []
        for url in [first, *(u for u in prefills.by_load() if u != first)]:
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

    async def prefill_layerwise(url: str, path: str, body: dict, headers: dict) -> None:
        """The prefill instance's part of a layerwise transfer (its answer is not the
        client's: a failure shows on the decode side, which recomputes or fails)."""
        with prefills.use(url):
            try:
                answer = await client.post(f"{url}{path}", json=body, headers=headers)
            except httpx.TransportError as e:
                logger.warning("prefill instance %s: %r", url, e)
                return
        if answer.status_code != 200:
            logger.warning("prefill instance %s: %d %s", url, answer.status_code, answer.text[:200])

    async def decode(
        request: Request, path: str, body: dict, headers: dict, prefilling: asyncio.Task | None
    ) -> Response:
        """The decode instance's answer, relayed; ``prefilling`` (a layerwise transfer's
        prefill request) is cancelled if the client leaves or the decode instance fails."""
        url = decodes.by_load()[0]
        decodes.acquire(url)
        try:
            upstream = await until_disconnect(
                request,
                client.send(
                    client.build_request("POST", f"{url}{path}", json=body, headers=headers),
                    stream=True,
                ),
            )
        except (ClientDisconnected, httpx.TransportError) as e:
            decodes.release(url)
            if prefilling is not None:
                prefilling.cancel()
            if isinstance(e, ClientDisconnected):
                logger.info("client left before the decode instance answered; aborted")
                return Response(status_code=499)
            return _error(502, f"decode instance {url}: {e!r}")

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:  # (also when the client disconnected: the decode side then aborts)
                await upstream.aclose()
                decodes.release(url)
                if prefilling is not None and not prefilling.done():
                    prefilling.cancel()

        return StreamingResponse(
            relay(),
            upstream.status_code,
            media_type=upstream.headers.get("content-type"),
        )

    async def proxy(request: Request, path: str) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError:
            return _error(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the request body is not a JSON object")
        headers = {k: v for k, v in request.headers.items() if k in _FORWARDED_HEADERS}
        try:
            picked = await until_disconnect(request, handshake(headers))
            if isinstance(picked, Response):
                return picked
            url, remote = picked
            if remote.get("kv_transfer_mode") == "layerwise":
                transfer_id = uuid.uuid4().hex
                params = {"do_remote_decode": True, "transfer_id": transfer_id}
                prefilling = asyncio.create_task(
                    prefill_layerwise(url, path, prefill_body(body, params), headers)
                )
                body["kv_transfer_params"] = {
                    "do_remote_prefill": True,
                    "transfer_id": transfer_id,
                    **remote,
                }
                return await decode(request, path, body, headers, prefilling)
            params = await until_disconnect(request, prefill(path, body, headers, url))
        except ClientDisconnected:  # (nobody reads the answer)
            logger.info("client left during the prefill; its request there was aborted")
            return Response(status_code=499)
        if isinstance(params, Response):
            return params
        body["kv_transfer_params"] = params
        return await decode(request, path, body, headers, None)

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
