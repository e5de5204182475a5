"""AsyncLLMEngine: an LLMEngine stepped by one background thread, consumed from asyncio.

The model step is blocking torch work, so it runs in a dedicated thread rather than on the event
loop. The engine itself is not thread-safe: every mutation (add, abort, shutdown) is queued as a
command and applied by the engine thread between steps. Outputs travel back to each request's
``asyncio.Queue`` through ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from heron.engine.llm_engine import LLMEngine
from heron.engine.request import Request
from heron.outputs import RequestOutput
from heron.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine has shut down and accepts no more requests."""


class StepError(RuntimeError):
    """A model step failed; the requests in flight were aborted."""


@dataclass(eq=False)
class _Stream:
    """Where the outputs of one request go: a queue owned by the caller's event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]
    children: list[Request]

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            pass  # the caller's loop is closed: nobody is listening any more


class AsyncLLMEngine:
    """Serve an :class:`LLMEngine` to asyncio callers; the engine runs in one background thread."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        # Commands are closures run by the engine thread; deque append/popleft are thread-safe.
        self._commands: deque[Callable[[], None]] = deque()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}  # touched only by the engine thread
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="heron-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ caller side (any thread)

    async def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes.

        An invalid request raises ``ValueError`` on the first iteration, before any output. If
        the caller stops iterating early (closes or cancels the generator), the request is
        aborted so its KV blocks return to the pool.
        """
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue(), [])
        added: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._submit(lambda: self._add(request_id, prompt, params, stream, added))
        finished = False
        try:
            await asyncio.wrap_future(added)
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine already dropped the request
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                # Commands run in order, so this abort lands after the add even when the caller
                # gave up before the add was applied.
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request; unknown or finished ids are ignored."""
        self._submit(lambda: self._abort(request_id))

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Finish in-flight requests with ``finish_reason="abort"`` and stop the engine thread."""
        if not self._stopped:
            self._submit(self._stop)
        self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive()

    def _submit(self, command: Callable[[], None]) -> None:
        if self._stopped or not self._thread.is_alive():
            raise EngineDeadError("the engine is shutting down")
        self._commands.append(command)
        self._wakeup.set()

    # ------------------------------------------------------------ engine thread

    def _run(self) -> None:
        while True:
            # Clear before draining: a command submitted after the drain sets the event again,
            # so the wait below cannot miss it.
            self._wakeup.clear()
            while self._commands:
                self._commands.popleft()()
            if self._stopped:
                return
            if not self.engine.has_unfinished_requests():
                self._wakeup.wait()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:
                # The step may have left these requests half-updated; aborting them frees their
                # blocks and keeps the engine usable for the next requests.
                logger.exception("engine step failed; aborting %d requests", len(self._streams))
                self._abort_all(StepError(f"the model step failed: {e!r}"))
                continue
            for output in outputs:
                self._deliver(output)

    def _add(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        stream: _Stream,
        added: concurrent.futures.Future[None],
    ) -> None:
        if not added.set_running_or_notify_cancel():
            return  # the caller went away before the request was added
        if self._stopped:
            # Queued behind the stop: nothing would step it any more.
            added.set_exception(EngineDeadError("the engine is shutting down"))
            return
        try:
            self.engine.add_request(request_id, prompt, params)
        except Exception as e:
            added.set_exception(e)
            return
        stream.children = self.engine.samples(request_id)
        self._streams[request_id] = stream
        added.set_result(None)

    def _abort(self, request_id: str) -> None:
        output = self.engine.abort_request(request_id)
        if output is not None:
            self._deliver(output)

    def _abort_all(self, error: BaseException | None = None) -> None:
        for request_id in list(self._streams):
            output = self.engine.abort_request(request_id)
            if error is not None:
                self._streams.pop(request_id).put(error)
            elif output is not None:
                self._deliver(output)

    def _stop(self) -> None:
        self._abort_all()
        self._stopped = True

    def _deliver(self, output: RequestOutput) -> None:
        stream = self._streams.get(output.request_id)
        if stream is None:
            return
        if output.finished:
            del self._streams[output.request_id]
            output.metrics = _timings(stream.children)
        stream.put(output)


def _timings(children: list[Request]) -> dict[str, float]:
    """Monotonic timestamps of a finished request, over all its samples."""
    timings = {
        "arrival_time": min(c.arrival_time for c in children),
        "finished_time": time.monotonic(),
    }
    scheduled = [c.first_scheduled_time for c in children if c.first_scheduled_time is not None]
    first_tokens = [c.first_token_time for c in children if c.first_token_time is not None]
    if scheduled:
        timings["first_scheduled_time"] = min(scheduled)
    if first_tokens:
        timings["first_token_time"] = min(first_tokens)
    return timings
