"""The engine core process: an :class:`LLMEngine` stepped in a process of its own.

``heron serve`` starts it (``python -m heron.engine.core_process ARGS``, ARGS the
:class:`CoreArgs` as JSON) so that the model step never waits on the HTTP front's GIL. It pulls
:data:`FrontMessage`s from one ZMQ socket and pushes one :class:`StepOutputs` per step to
another. It exits on :class:`Shutdown`, and on its own when the front dies (its standard input,
the front's pipe, reaches end of file), so it is never left orphaned.
"""

from __future__ import annotations

import logging
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import zmq

from heron.distributed.executor import WorkerDiedError
from heron.engine.llm_engine import LLMEngine
from heron.engine.messages import (
    AbortRequest,
    AddRequest,
    CoreArgs,
    CoreMessage,
    EngineStats,
    FrontMessage,
    Ready,
    Rejected,
    RequestDelta,
    SampleDelta,
    Shutdown,
    StartupFailed,
    StepFailed,
    StepOutputs,
)
from heron.engine.request import Request
from heron.server.serve import freeze_start_up_heap

logger = logging.getLogger(__name__)

# Stats go out at most this often while requests run (always once the engine is idle).
STATS_INTERVAL_S = 0.1
# How long an idle core waits for a message before it checks the front is still there.
IDLE_POLL_MS = 1000
# Errors a user can fix (a bad path or value): reported by their message, without a traceback.
_USER_ERRORS = (ValueError, OSError)


@dataclass(eq=False)
class _Sent:
    """How much of one request's output the front has been sent."""

    children: list[Request]
    tokens: list[int]  # per sample
    finished: list[bool]  # per sample
    first_sent: bool = False


class EngineCore:
    """The core's loop: apply the front's messages, step, send each step's new tokens."""

    def __init__(
        self, engine: LLMEngine, inbox: zmq.Socket, outbox: zmq.Socket, front_fd: int
    ) -> None:
        """``front_fd``: the read end of a pipe the front holds open; readable (end of file)
        once the front is gone."""
        self.engine = engine
        self.inbox, self.outbox, self.front_fd = inbox, outbox, front_fd
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FrontMessage)
        self._poller = zmq.Poller()
        self._poller.register(inbox, zmq.POLLIN)
        self._poller.register(front_fd, zmq.POLLIN)
        self._live: dict[str, _Sent] = {}
        self._deltas: list[RequestDelta] = []
        self._stats: EngineStats | None = None
        self._stats_time = 0.0

    def send(self, message: CoreMessage) -> None:
        self.outbox.send(self._encoder.encode(message), copy=False)

    def run(self) -> None:
        while self._receive(0 if self.engine.has_unfinished_requests() else IDLE_POLL_MS):
            if self.engine.has_unfinished_requests():
                self._step()
            self._publish()

    def _receive(self, timeout_ms: int) -> bool:
        """Apply every waiting message; False once the core should exit."""
        events = dict(self._poller.poll(timeout_ms))
        if self.front_fd in events:
            logger.error("the front process is gone; the engine core exits")
            return False
        while events:
            try:
                frame = self.inbox.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            message = self._decoder.decode(frame.buffer)
            if isinstance(message, AddRequest):
                self._add(message)
            elif isinstance(message, AbortRequest):
                self._abort(message.request_id, message.sample_index)
            else:
                assert isinstance(message, Shutdown)
                for request_id in list(self._live):
                    self._abort(request_id)
                self._publish()
                return False
        return True

    def _abort(self, request_id: str, sample_index: int | None = None) -> None:
        output = self.engine.abort_request(request_id, sample_index)
        if output is not None:
            self._collect(request_id, output.finished)

    def _add(self, message: AddRequest) -> None:
        request_id = message.request_id
        try:
            # Outputs of finished requests only: deltas are read off the samples themselves.
            self.engine.add_request(
                request_id, message.prompt_token_ids, message.params, stream=False
            )
        except ValueError as e:
            self.send(Rejected(request_id, str(e)))
            return
        children = self.engine.samples(request_id)
        self._live[request_id] = _Sent(children, [0] * len(children), [False] * len(children))

    def _step(self) -> None:
        try:
            finished = {output.request_id for output in self.engine.step()}
        except Exception as e:
            # The step may have left these requests half-updated; aborting them frees their
            # blocks and keeps the engine usable for the next requests.
            logger.exception("engine step failed; aborting %d requests", len(self._live))
            request_ids = list(self._live)
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            self._live.clear()
            self.send(StepFailed(request_ids, f"the model step failed: {e!r}"))
            if isinstance(e, WorkerDiedError):
                raise  # no later step can run: the core exits, the front reports it dead
            return
        for request_id in list(self._live):
            self._collect(request_id, request_id in finished)

    def _collect(self, request_id: str, finished: bool) -> None:
        """Queue what the request's samples gained since its front was last sent a delta."""
        sent = self._live.get(request_id)
        if sent is None:
            return
        samples = []
        for index, child in enumerate(sent.children):
            start, end = sent.tokens[index], len(child.output_token_ids)
            reason = child.finish_reason
            if end == start and (reason is None or sent.finished[index]):
                continue
            sent.tokens[index], sent.finished[index] = end, reason is not None
            wants_logprobs = child.sampling_params.logprobs is not None
            samples.append(
                SampleDelta(
                    index,
                    child.output_token_ids[start:end],
                    child.logprobs[start:end] if wants_logprobs else None,
                    None if reason is None else reason.value,
                    child.stop_reason,  # a stop token: stop strings are the front's
                )
            )
        if not samples and not finished:
            return
        first = sent.children[0]
        delta = RequestDelta(request_id, samples, finished, first.num_cached_tokens)
        if not sent.first_sent:
            sent.first_sent = True
            if first.wants_prompt_logprobs:
                delta.prompt_logprobs = list(first.prompt_logprobs)
            scheduled = [c.first_scheduled_time for c in sent.children]
            delta.first_scheduled_time = min((t for t in scheduled if t is not None), default=None)
        if finished:
            del self._live[request_id]
        self._deltas.append(delta)

    def _publish(self) -> None:
        """Send the queued deltas, with the engine's stats when they changed and are due."""
        now = time.monotonic()
        stats = None
        idle = not self.engine.has_unfinished_requests()
        if idle or now - self._stats_time >= STATS_INTERVAL_S:
            stats = EngineStats.of(self.engine)
            if stats == self._stats:
                stats = None
            else:
                self._stats, self._stats_time = stats, now
        if self._deltas or stats is not None:
            self.send(StepOutputs(self._deltas, stats))
            self._deltas = []


def run_engine_core(args: CoreArgs) -> int:
    """Build the engine, report ready (or why not), and serve the front until told to stop."""
    # Ctrl-C reaches the whole process group; the front decides how the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    context = zmq.Context()
    outbox = context.socket(zmq.PUSH)
    outbox.connect(args.output_address)
    inbox = context.socket(zmq.PULL)
    inbox.connect(args.input_address)
    try:
        core = _start(args, inbox, outbox)
        if core is not None:
            try:
                core.run()
            finally:
                core.engine.shutdown()
    finally:
        # Linger, so the last outputs reach the front before the process ends.
        outbox.close(linger=5000)
        inbox.close(linger=0)
        context.term()
        # The sockets' directory: the front removes it too, unless it was killed.
        shutil.rmtree(Path(args.input_address.removeprefix("ipc://")).parent, ignore_errors=True)
    return 0 if core is not None else 1


def _start(args: CoreArgs, inbox: zmq.Socket, outbox: zmq.Socket) -> EngineCore | None:
    encoder = msgspec.msgpack.Encoder()
    try:
        engine = LLMEngine(args.config, detokenize=False)
    except Exception as e:
        if not isinstance(e, _USER_ERRORS):
            logger.exception("the engine core failed to start")
        outbox.send(encoder.encode(StartupFailed(str(e) or type(e).__name__)))
        return None
    core = EngineCore(engine, inbox, outbox, sys.stdin.fileno())
    mc = engine.model_config
    freeze_start_up_heap()
    core.send(
        Ready(
            str(mc.path),
            str(args.config.tokenizer or mc.path),
            mc.max_model_len,
            sorted(engine.eos_token_ids),
            _describe(engine),
            EngineStats.of(engine),
        )
    )
    return core


def _describe(engine: LLMEngine) -> str:
    graphs = engine.runner.graphs
    mode = "eager" if graphs is None else f"CUDA graphs for decode batches up to {graphs.max_batch}"
    dtype = str(engine.model_config.dtype).removeprefix("torch.")
    return f"dtype {dtype}, device {engine.platform.device}, graph mode {mode}"


def main() -> int:
    args = msgspec.json.decode(sys.argv[1], type=CoreArgs)
    # As the front's logging (heron's own start-up lines at least at INFO), one stream for both.
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("heron").setLevel(min(logging.INFO, logging.getLogger().level))
    return run_engine_core(args)


if __name__ == "__main__":
    sys.exit(main())
