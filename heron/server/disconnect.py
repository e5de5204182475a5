"""A client's going away while a handler awaits something (the server's and the router's)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The HTTP client went away; its requests are aborted."""


async def wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client goes away first, cancel it (which aborts the requests it
    added) and raise :class:`ClientDisconnected`."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()
