"""What one HTTP front runs: the API over its :class:`EngineCoreClient`, under uvicorn, until
SIGTERM / Ctrl-C. ``heron serve`` runs one (:func:`serve`, which starts the engine core too) or
several beside a launcher (:mod:`heron.server.api_servers`); the command line chooses."""

from __future__ import annotations

import logging
import signal
import socket
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from heron.config import EngineConfig
from heron.engine.core_client import EngineCoreClient
from heron.engine.core_launch import freeze_start_up_heap
from heron.multimodal.media import MediaPolicy
from heron.server.access_log import AccessLog
from heron.server.app import build_app, error_response
from heron.server.chat_output import ChatOutputConfig
from heron.server.security import DEFAULT_TIMEOUT_KEEP_ALIVE_S, HeaderDeadlineH11, with_cors

logger = logging.getLogger(__name__)


class _RefuseWhileStopping:
    """ASGI middleware answering 503 at once to every request that starts after the shutdown
    signal, instead of letting it wait on an engine that is stopping."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.stopping = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.stopping and scope["type"] == "http":
            response = error_response(503, "the server is shutting down")
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class _NameTheFront:
    """ASGI middleware naming the front process that answered (``x-heron-api-server``), for
    telling several fronts on one port apart."""

    def __init__(self, app: ASGIApp, index: int) -> None:
        self.app, self.header = app, (b"x-heron-api-server", str(index).encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), self.header]
            await send(message)

        await self.app(scope, receive, send_named)


class _Server(uvicorn.Server):
    """uvicorn's server, ending in-flight generations as soon as a shutdown signal arrives,
    and shutting down (``engine_died``) once the engine core is gone.

    uvicorn's graceful shutdown waits for open responses to complete; without this a long
    stream would hold the shutdown until it ran out of tokens. A front without its core could
    only answer 503; exiting lets a supervisor restart the service, as vLLM's API server does.
    """

    def __init__(
        self, config: uvicorn.Config, engine: EngineCoreClient, gate: _RefuseWhileStopping
    ) -> None:
        super().__init__(config)
        self.engine, self.gate = engine, gate
        self.engine_died = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.gate.stopping = True
        super().handle_exit(sig, frame)
        # A signal handler must not block: the lifespan's exit joins the engine core.
        self.engine.shutdown(timeout=0)

    async def on_tick(self, counter: int) -> bool:
        if not self.should_exit and not self.engine.is_running:
            # Its requests have failed with 503 already (the core's exit wakes the client).
            logger.error("the engine core is gone; this API server shuts down")
            self.engine_died = self.gate.stopping = self.should_exit = True
        return await super().on_tick(counter)


@dataclass(frozen=True)
class ServeOptions:
    """How a front serves its engine: the ``heron serve`` flags other than the engine's."""

    host: str
    port: int
    api_key: str | None
    served_model_name: str | None
    model: str | None  # as given (the default name)
    log_level: str
    max_request_body_bytes: int
    trust_request_chat_template: bool
    chat_output: ChatOutputConfig = ChatOutputConfig()
    allowed_origins: tuple[str, ...] = ()  # CORS: the web origins that may call the API
    timeout_keep_alive: int = DEFAULT_TIMEOUT_KEEP_ALIVE_S  # idle and header-read deadline
    chat_template: str | None = None  # instead of the tokenizer's
    lora_modules: tuple[tuple[str, str], ...] = ()  # LoRA adapters served: (name, path)
    media: MediaPolicy = MediaPolicy()  # where requests' images may come from


def serve(config: EngineConfig, options: ServeOptions, listener: socket.socket) -> int:
    """One front on ``listener`` and the engine core it starts: serve until a shutdown signal
    (0) or the engine core's death (1); returns the exit code."""
    with listener:
        engine = EngineCoreClient(config, logging.getLevelName(logging.getLogger().level))
        logger.info("listening on http://%s:%d (OpenAI API under /v1)", options.host, options.port)
        return run_front(engine, options, [listener])


def listen(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound before the model loads (a port in use fails at
    once); ``ValueError`` saying why it cannot be had."""
    try:
        return socket.create_server((host, port), backlog=4096)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e


def run_front(
    engine: EngineCoreClient,
    options: ServeOptions,
    sockets: list[socket.socket] | None = None,
    index: int | None = None,
) -> int:
    """Run the API over ``engine`` under uvicorn until a shutdown signal (0) or the engine
    core's death (1), on ``sockets`` (the listening socket, which several fronts may share) or
    on the options' host and port; ``index``: this front's, sent in every response's
    ``x-heron-api-server`` header."""
    name = options.served_model_name or options.model or Path(engine.model_path).stem
    if not index:  # one line for the server, not one per front
        logger.info(
            "serving %s as %r: %s, max_model_len %d (cache groups as logged above); engine "
            "core process %d",
            engine.model_path,
            name,
            engine.description,
            engine.max_model_len,
            engine.core_pid,
        )
    try:
        app = build_app(
            engine,
            name,
            options.api_key,
            options.max_request_body_bytes,
            options.trust_request_chat_template,
            options.chat_output,
            options.chat_template,
            options.lora_modules,
            options.media,
            engine.image_limit,
        )
    except BaseException:
        engine.shutdown()
        raise
    served = AccessLog(with_cors(app, options.allowed_origins))
    gate = _RefuseWhileStopping(served if index is None else _NameTheFront(served, index))
    uv_config = uvicorn.Config(
        gate,
        host=options.host,
        port=options.port,
        log_level=options.log_level.lower(),
        timeout_graceful_shutdown=30,
        timeout_keep_alive=options.timeout_keep_alive,
        http=HeaderDeadlineH11,
        access_log=False,  # AccessLog writes one line per request, with its id
    )
    # uvicorn re-raises the shutdown signal once it has shut down gracefully; the default
    # handlers would then turn a clean shutdown into a nonzero exit status.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    freeze_start_up_heap()
    server = _Server(uv_config, engine, gate)
    server.run(sockets=sockets)
    if not (server.started or server.engine_died or gate.stopping):
        return 2  # its start-up failed (a --lora-modules adapter refused: logged above)
    return 1 if server.engine_died else 0
