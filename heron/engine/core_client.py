"""EngineCoreClient: the HTTP front's handle on the engine core process.

It starts the core (:mod:`heron.engine.core_process`), sends it token ids and sampling
parameters, and turns the token deltas the core streams back into :class:`RequestOutput`s
through the :class:`OutputProcessor` the offline API uses too: detokenisation and stop strings
happen here, in the front, so the core's step loop never shares a GIL with them. A stop string
the front matches aborts that sample in the core. Nothing here imports model code.

One thread reads the core's messages (it waits in ZMQ, without the GIL) and hands each batch
to the event loop; it also watches the core process, so a core that dies fails every request
at once with :class:`EngineDeadError`. With several fronts (``--api-server-count``) each is
one client, attached to the core a launcher started (:meth:`EngineCoreClient.attach`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import uuid
from collections.abc import AsyncIterator, Callable

import msgspec
import zmq
from transformers import AutoTokenizer

from heron.config import EngineConfig
from heron.engine.core_launch import CoreProcess, WatchedCore, front_endpoints, remove_sockets
from heron.engine.messages import (
    AbortRequest,
    AdapterAdded,
    AddAdapter,
    AddPoolingRequest,
    AddRequest,
    Control,
    ControlDone,
    CoreMessage,
    EngineStats,
    FrontEndpoints,
    FrontMessage,
    ImageData,
    Ready,
    Rejected,
    RemoveAdapter,
    Shutdown,
    StartupFailed,
    StepFailed,
    StepOutputs,
)
from heron.engine.output_processor import OutputProcessor
from heron.lora.request import LoRARequest
from heron.multimodal.inputs import ImageItem
from heron.outputs import PoolingRequestOutput, RequestOutput
from heron.pooling_params import PoolingParams
from heron.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


# How long one send waits for the core's connection before checking the core still runs.
SEND_WAIT_MS = 100


class EngineDeadError(RuntimeError):
    """The engine has shut down (or its process died) and accepts no more requests."""


class StepError(RuntimeError):
    """A model step failed (the requests in flight were aborted), or a request did (its KV
    read failed and the connector fails it)."""


class EngineUnavailableError(RuntimeError):
    """The engine takes no requests now (asleep, or generation paused)."""


class ControlArgumentError(ValueError):
    """A control call's argument the engine refused (an unknown tag, a bad path)."""


class ControlConflictError(RuntimeError):
    """A control call the engine's state refuses now (sleeping twice, requests unfinished)."""


class EngineStartupError(RuntimeError):
    """The engine core could not start (a bad model path, too little memory, ...)."""


class EngineCoreClient:
    """The engine core in its own process, served to asyncio callers: ``generate``, ``abort``,
    ``shutdown``, ``is_running``, plus what the front needs of the engine (``tokenizer``,
    ``max_model_len``, ``model_path``, ``stats``)."""

    def __init__(self, config: EngineConfig, log_level: str = "INFO") -> None:
        """Start the core, the only front's, and wait until its engine is built; raise
        :class:`EngineStartupError` with the core's reason if it cannot be."""
        (endpoints,) = front_endpoints(1)
        self._connect(endpoints, lambda: CoreProcess(config, log_level, [endpoints]))

    @classmethod
    def attach(cls, endpoints: FrontEndpoints, core_pid: int) -> EngineCoreClient:
        """The client of one of several fronts, on the core a launcher started (which also
        stops it: :meth:`shutdown` only ends this front's requests)."""
        client = cls.__new__(cls)
        client._connect(endpoints, lambda: WatchedCore(core_pid))
        return client

    def _connect(
        self, endpoints: FrontEndpoints, core: Callable[[], CoreProcess | WatchedCore]
    ) -> None:
        """Start or watch the core (``core``), bind this front's sockets (the core connects
        to them) and wait for its engine."""
        try:
            self._core = core()
        except ProcessLookupError:
            raise EngineStartupError("the engine core process is gone") from None
        self._endpoints = endpoints
        self._context = zmq.Context()
        self._to_core = self._context.socket(zmq.PUSH)
        self._from_core = self._context.socket(zmq.PULL)
        for socket in (self._to_core, self._from_core):
            socket.setsockopt(zmq.SNDHWM, 0)  # never drop nor block: the queues are bounded
            socket.setsockopt(zmq.RCVHWM, 0)  # by the requests in flight
        self._to_core.setsockopt(zmq.SNDTIMEO, SEND_WAIT_MS)
        self._to_core.bind(endpoints.input_address)
        self._from_core.bind(endpoints.output_address)
        self._send_lock = threading.RLock()  # a signal handler may send inside a send
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CoreMessage)
        # Both touched on the event loop only: each request's consumer, and its outputs.
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._closed = False
        self._wake_read, self._wake_write = os.pipe()  # tells the reader thread to stop
        self._poller = zmq.Poller()  # the start-up's, then the reader thread's
        self._poller.register(self._from_core, zmq.POLLIN)
        self._poller.register(self._core.exit_fd, zmq.POLLIN)
        self._poller.register(self._wake_read, zmq.POLLIN)
        try:
            ready = self._wait_ready()
            self.tokenizer = AutoTokenizer.from_pretrained(ready.tokenizer)
        except BaseException:
            if self._core_owned():
                self._core.kill()
            self._close()
            raise
        self.max_model_len = ready.max_model_len
        self.model_path = ready.model_path
        self.description = ready.description
        self.stats: EngineStats = ready.stats  # the newest snapshot the core sent
        self.pooling = ready.pooling  # a pooling model's pooler; None: the model generates
        self.sleep_mode = ready.sleep_mode
        self.image_limit = ready.image_limit
        self.kv_transfer = ready.kv_transfer  # a KV connector's handshake (None: none)
        self._calls: dict[int, asyncio.Future] = {}  # control calls waiting for the core
        self._call_ids = itertools.count()
        self._outputs = OutputProcessor(self.tokenizer, ready.eos_token_ids)
        self._reader = threading.Thread(target=self._read, name="heron-core-reader", daemon=True)
        self._reader.start()

    @property
    def core_pid(self) -> int:
        return self._core.pid

    @property
    def is_running(self) -> bool:
        return not self._closed and self._core.running

    # ------------------------------------------------------------ event loop side

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        lora_request: LoRARequest | None = None,
        images: tuple[ImageItem, ...] = (),
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes (under ``lora_request``'s adapter,
        one :meth:`add_lora` gave; ``images``: the prompt's, placeholders expanded).

        An invalid request raises ``ValueError`` on the first iteration, before any output. If
        the caller stops iterating early (closes or cancels the generator), the request is
        aborted so its KV blocks return to the pool.
        """
        queue = self._open(request_id)
        token_ids = list(prompt_token_ids)
        self._outputs.add_request(request_id, None, token_ids, params)
        wire = [ImageData.of(item) for item in images]
        front = self._endpoints.index
        self._send(AddRequest(request_id, token_ids, params, front, lora_request, wire))
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the core already dropped the request
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._forget(request_id)
                self.abort(request_id)

    async def pool(
        self, request_id: str, prompt_token_ids: list[int], params: PoolingParams
    ) -> PoolingRequestOutput:
        """A pooling request's answer. An invalid request raises ``ValueError``; a caller
        cancelled while it waits aborts the request."""
        queue = self._open(request_id)
        token_ids = list(prompt_token_ids)
        self._send(AddPoolingRequest(request_id, token_ids, params, self._endpoints.index))
        try:
            item = await queue.get()
        except asyncio.CancelledError:
            self._forget(request_id)
            self.abort(request_id)
            raise
        if isinstance(item, BaseException):
            raise item
        return PoolingRequestOutput(request_id, token_ids, item.pooled)

    async def control(self, method: str, **arguments: object) -> object:
        """Call the engine's ``method`` (:data:`~heron.engine.messages.CONTROL_METHODS`: sleep,
        wake-up, weight reloads, pause) in the core; its result. Raises
        :class:`ControlArgumentError` for a bad argument, :class:`ControlConflictError` where
        the engine's state refuses it."""
        if self._stopping or not self.is_running:
            raise self._dead_error()
        self._loop = asyncio.get_running_loop()
        call_id = next(self._call_ids)
        future = self._calls[call_id] = self._loop.create_future()
        self._send(Control(call_id, method, arguments, self._endpoints.index))
        return await future

    def _open(self, request_id: str) -> asyncio.Queue:
        """A new request's queue of outputs; raises while the core is not running, or for an
        id in use."""
        if self._stopping or not self.is_running:
            raise self._dead_error()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._loop = asyncio.get_running_loop()
        queue = self._streams[request_id] = asyncio.Queue()
        return queue

    async def add_lora(self, lora_name: str, lora_path: str) -> LoRARequest:
        """Have the core read and check an adapter; its request for :meth:`generate`, or
        ``ValueError`` naming what does not fit."""
        call_id = f"lora-{uuid.uuid4().hex}"
        queue = self._open(call_id)
        self._send(AddAdapter(call_id, lora_name, lora_path, self._endpoints.index))
        result = await queue.get()
        if isinstance(result, BaseException):
            raise result
        return result

    def remove_lora(self, lora_name: str) -> None:
        """Have the core forget an adapter (requests naming it may still finish)."""
        if self.is_running:
            self._send(RemoveAdapter(lora_name))

    def abort(self, request_id: str) -> None:
        """Stop a request; unknown or finished ids are ignored, and so is a core not running
        (nothing runs there to stop)."""
        if self.is_running:
            self._send(AbortRequest(request_id))

    def _send(self, message: FrontMessage) -> None:
        """Send, or drop the message once the core is gone. A PUSH socket waits for a peer
        (its queue is unbounded, so that is all it waits for): briefly, while the core's
        connection is being made, and for ever once the core has exited, so the wait is
        bounded (``SEND_WAIT_MS``) and the core's exit checked between tries; the reader thread
        reports that exit to every request."""
        frame = self._encoder.encode(message)
        with self._send_lock:
            while True:
                try:
                    self._to_core.send(frame, copy=False)
                    return
                except zmq.Again:
                    if not self._core.running:
                        logger.debug("the engine core is gone; %s dropped", type(message).__name__)
                        return

    def _apply(self, messages: list[CoreMessage]) -> None:
        """Deliver a batch of the core's messages: one output per request however many steps
        the batch holds, so a front that falls behind catches up with fewer, larger chunks."""
        deltas = []
        for message in messages:
            if isinstance(message, StepOutputs):
                for delta in message.deltas:
                    if delta.pooled is None:
                        deltas.append(delta)
                    elif (queue := self._streams.pop(delta.request_id, None)) is not None:
                        queue.put_nowait(delta)  # a pooling request's one answer
            elif isinstance(message, Rejected):
                error = EngineUnavailableError if message.unavailable else ValueError
                self._fail(message.request_id, error(message.message))
            elif isinstance(message, AdapterAdded):
                queue = self._streams.pop(message.call_id, None)
                if queue is not None:
                    queue.put_nowait(message.lora_request)
            elif isinstance(message, ControlDone):
                self._settle_call(message)
            elif isinstance(message, StepFailed):
                for request_id in message.request_ids:
                    self._fail(request_id, StepError(message.message))
        processed = self._outputs.process(deltas)
        for abort in processed.aborts:  # samples a stop string ended here
            self._send(abort)
        for output in processed.outputs:
            if output.finished:
                queue = self._streams.pop(output.request_id)
            else:
                queue = self._streams[output.request_id]
            queue.put_nowait(output if output.error is None else StepError(output.error))

    def _settle_call(self, done: ControlDone) -> None:
        future = self._calls.pop(done.call_id, None)
        if future is None or future.done():
            return
        if done.error is None:
            future.set_result(done.value)
        else:
            invalid = done.error_kind == "invalid"
            error = ControlArgumentError if invalid else ControlConflictError
            future.set_exception(error(done.error))

    def _forget(self, request_id: str) -> asyncio.Queue | None:
        self._outputs.abort(request_id)
        return self._streams.pop(request_id, None)

    def _fail(self, request_id: str, error: BaseException) -> None:
        queue = self._forget(request_id)
        if queue is not None:
            queue.put_nowait(error)

    def _fail_all(self, error: BaseException) -> None:
        for request_id in list(self._streams):
            self._fail(request_id, error)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
        self._calls.clear()

    # ------------------------------------------------------------ reader thread

    def _wait_ready(self) -> Ready:
        while True:
            messages, exited, _ = self._receive()
            for message in messages:
                if isinstance(message, Ready):
                    return message
                if isinstance(message, StartupFailed):
                    if self._core_owned():
                        self._core.stop(timeout=30)
                    raise EngineStartupError(message.message)
            if exited:
                if self._core_owned():
                    self._core.stop(timeout=None)
                raise EngineStartupError(
                    f"the engine core exited{self._exit_code()} during start-up (its log is above)"
                )

    def _receive(self) -> tuple[list[CoreMessage], bool, bool]:
        """Wait for messages, the core's exit or the wake-up; return every message waiting,
        whether the core has exited (its last messages are read before its exit is reported)
        and whether the reader was woken to stop."""
        events = dict(self._poller.poll())
        messages = []
        while True:
            try:
                frame = self._from_core.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return messages, self._core.exit_fd in events, self._wake_read in events
            messages.append(self._decoder.decode(frame.buffer))

    def _read(self) -> None:
        """Hand the core's messages to the event loop, in batches, until the core exits (or
        :meth:`shutdown` wakes this thread to stop)."""
        while True:
            messages, exited, woken = self._receive()
            stats = [m.stats for m in messages if isinstance(m, StepOutputs) and m.stats]
            if stats:
                self.stats = stats[-1]
            if messages:
                self._call_on_loop(self._apply, messages)
            if exited:
                if self._core_owned():
                    self._core.stop(timeout=None)  # reaps it: its exit code
                error = self._dead_error()
                if not self._stopping:
                    logger.error("%s", error)
                self._call_on_loop(self._fail_all, error)
                return
            if woken:
                return

    def _core_owned(self) -> bool:
        return isinstance(self._core, CoreProcess)

    def _exit_code(self) -> str:
        code = self._core.exit_code
        return "" if code is None else f" with code {code}"

    def _dead_error(self) -> EngineDeadError:
        if self._stopping:
            return EngineDeadError("the engine is shutting down")
        return EngineDeadError(f"the engine core process died{self._exit_code()}")

    def _call_on_loop(self, function: Callable[[object], None], argument: object) -> None:
        if self._loop is None:
            return  # no request was ever made: nobody to tell
        try:
            self._loop.call_soon_threadsafe(function, argument)
        except RuntimeError:
            pass  # the loop is closed: nobody is listening any more

    # ------------------------------------------------------------ shutdown

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Finish in-flight requests with ``finish_reason="abort"`` and stop the core: wait up
        to ``timeout`` seconds (None: as long as it takes) for it to exit, then kill it.
        ``timeout=0`` only asks (a signal handler must not block). An attached front ends only
        its own requests and leaves the core to its launcher."""
        if not self._stopping:
            self._stopping = True
            if self.is_running and self._core_owned():
                self._send(Shutdown())
            elif self.is_running:
                for request_id in list(self._streams):
                    self._send(AbortRequest(request_id))
        if timeout == 0 or self._closed:
            return
        if not self._core_owned():
            os.write(self._wake_write, b"\0")
        elif not self._core.stop(timeout):
            logger.warning("the engine core did not stop within %.0f s; killed it", timeout)
        self._reader.join()
        self._close()

    def _close(self) -> None:
        self._closed = True
        self._core.close()
        os.close(self._wake_read)
        os.close(self._wake_write)
        self._to_core.close(linger=0)
        self._from_core.close(linger=0)
        self._context.term()
        if self._core_owned():
            remove_sockets(self._endpoints)  # a launcher removes those of its fronts
