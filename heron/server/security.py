"""What keeps a local server safe from web pages and idle connections: CORS for the origins the
operator allows (none by default) and a deadline on each request's headers."""

from __future__ import annotations

import asyncio
import json

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp
from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle

# uvicorn's own default for idle keep-alive connections; also the deadline on request headers.
DEFAULT_TIMEOUT_KEEP_ALIVE_S = 5


def parse_allowed_origins(text: str) -> tuple[str, ...]:
    """``--allowed-origins``: a JSON list of origins, as vLLM takes it (``["*"]``: any)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--allowed-origins must be a JSON list of origins: {e}") from None
    if not isinstance(value, list) or not all(isinstance(o, str) and o for o in value):
        raise ValueError(f"--allowed-origins must be a JSON list of origins, got {text}")
    return tuple(value)


def with_cors(app: ASGIApp, allowed_origins: tuple[str, ...]) -> ASGIApp:
    """``app`` behind Starlette's CORS middleware: preflights of other origins are refused,
    and a browser lets only the allowed origins read the responses. Credentials are never
    allowed (the API key is a header a page must send on purpose)."""
    return CORSMiddleware(
        app,
        allow_origins=list(allowed_origins),
        allow_methods=["GET", "POST"],
        allow_headers=["authorization", "content-type", "x-request-id"],
        expose_headers=["x-request-id"],
    )


class HeaderDeadlineH11(H11Protocol):
    """uvicorn's h11 protocol that closes a connection whose next request's headers have not
    arrived within ``timeout_keep_alive`` seconds of its opening or of its last response.

    uvicorn times out only connections that stay silent between requests; one that sends half
    a header (or nothing, once opened) would be held forever, and a few hundred of them exhaust
    the server's file descriptors.
    """

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._set_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._set_deadline()

    def _set_deadline(self) -> None:
        self.loop.call_later(self.timeout_keep_alive, self._close_if_no_request, self.cycle)

    def _close_if_no_request(self, cycle: RequestResponseCycle | None) -> None:
        # A new request's headers make a new cycle (a pipelined one may have been made before
        # the deadline was set: it is still answering).
        answering = cycle is not None and not cycle.response_complete
        if self.cycle is cycle and not answering and not self.transport.is_closing():
            self.transport.close()
