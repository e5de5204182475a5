"""One log line per request, under the request's id (``X-Request-Id``: the client's, or one
made here), which every response carries back."""

from __future__ import annotations

import logging
import re
import time
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from heron.server.app import error_response

logger = logging.getLogger("heron.access")

# What a client's id may be: visible ASCII, short (it goes into every log line).
_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")


class AccessLog:
    """ASGI middleware: take or make the request's id, echo it as ``X-Request-Id``, and log
    ``client request-id "METHOD path" status milliseconds`` once the response has ended."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id")
        start, status = time.monotonic(), None
        if given is not None and not _REQUEST_ID.fullmatch(given.decode("latin-1")):
            request_id = uuid.uuid4().hex
            app = error_response(
                400,
                "the X-Request-Id header must be 1 to 128 visible ASCII characters",
                param="X-Request-Id",
            )
        else:
            request_id, app = (given.decode() if given else uuid.uuid4().hex), self.app
        header = (b"x-request-id", request_id.encode())

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), header]
            await send(message)

        try:
            await app(scope, receive, send_with_id)
        finally:
            client = scope.get("client")
            logger.info(
                '%s %s "%s %s" %s %.0f ms',
                f"{client[0]}:{client[1]}" if client else "-",
                request_id,
                scope["method"],
                scope["path"],
                status or "-",
                (time.monotonic() - start) * 1000,
            )
