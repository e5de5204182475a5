"""Request bodies: read under a size limit, parsed off the event loop that serves other clients."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from typing import TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

DEFAULT_MAX_REQUEST_BODY_BYTES = 16 << 20
# Work on more input than this (bytes of JSON, characters of text) goes to a worker thread;
# below it the hop would cost more than the work.
OFF_LOOP_THRESHOLD = 1 << 16

Body = TypeVar("Body", bound=BaseModel)
T = TypeVar("T")


class UnsupportedMediaTypeError(Exception):
    """A JSON route's body is not declared as JSON (answered 415). Reading it anyway would let
    any web page drive the server: a ``text/plain`` POST is a CORS "simple request", which a
    browser sends without asking the server first."""

    def __init__(self, content_type: str | None) -> None:
        super().__init__(
            f"the request body must be JSON (Content-Type: application/json), "
            f"not {content_type or 'undeclared'}"
        )


def _declares_json(content_type: str | None) -> bool:
    """``application/json`` or ``application/*+json``, with any parameters (FastAPI's rule)."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    kind, _, subtype = media.partition("/")
    return kind == "application" and (subtype == "json" or subtype.endswith("+json"))


class BodyTooLargeError(Exception):
    """The body is larger than the server accepts (answered 413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the request body is larger than this server's limit of {limit} bytes")


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body; stops reading as soon as it passes ``limit`` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLargeError(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise BodyTooLargeError(limit)
    return bytes(body)


async def off_loop_if_large(
    size: float, work: Callable[[], T], executor: Executor | None = None
) -> T:
    """``work()``, in ``executor`` (default: the loop's) when ``size`` passes the threshold, so
    that /health and the other clients' streams are answered meanwhile."""
    if size <= OFF_LOOP_THRESHOLD:
        return work()
    return await asyncio.get_running_loop().run_in_executor(executor, work)


async def parse_body(request: Request, model: type[Body], limit: int) -> Body:
    """Read and validate the body as ``model`` (a large one in a worker thread), if it is
    declared as JSON."""
    content_type = request.headers.get("content-type")
    if not _declares_json(content_type):
        raise UnsupportedMediaTypeError(content_type)
    body = await read_body(request, limit)
    try:
        return await off_loop_if_large(len(body), lambda: model.model_validate_json(body))
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False)) from e
