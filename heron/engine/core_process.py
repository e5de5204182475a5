"""The engine core process: an :class:`LLMEngine` stepped in a process of its own.

``heron serve`` starts it (``python -m heron.engine.core_process ARGS``, ARGS the
:class:`CoreArgs` as JSON) so that the model step never waits on an HTTP front's GIL. It pulls
:data:`FrontMessage`s from every front's input socket and pushes one :class:`StepOutputs` per
step to each front that has new tokens (or stats to take), each request's outputs to the front
that sent it. It exits on :class:`Shutdown`, and on its own when the process that started it is
gone (its standard input, that process's pipe, reaches end of file), so it is never orphaned.
"""

from __future__ import annotations

import logging
import signal
import sys
import time

import msgspec
import zmq

from heron.distributed.executor import WorkerDiedError
from heron.engine.core_launch import freeze_start_up_heap, remove_sockets
from heron.engine.deltas import RequestDelta
from heron.engine.llm_engine import LLMEngine
from heron.engine.messages import (
    CONTROL_METHODS,
    AbortRequest,
    AdapterAdded,
    AddAdapter,
    AddPoolingRequest,
    AddRequest,
    Control,
    ControlDone,
    CoreArgs,
    CoreMessage,
    EngineStats,
    FrontMessage,
    Ready,
    Rejected,
    RemoveAdapter,
    Shutdown,
    StartupFailed,
    StepFailed,
    StepOutputs,
)
from heron.lora.request import LoRARequest
from heron.platforms import resolve_device, set_server_cpu_threads

logger = logging.getLogger(__name__)

# Stats go out at most this often while requests run (always once the engine is idle).
STATS_INTERVAL_S = 0.1
# How long an idle core waits for a message before it checks the front is still there.
IDLE_POLL_MS = 1000
HELD_POLL_MS = 20
# Errors a user can fix (a bad path or value): reported by their message, without a traceback.
_USER_ERRORS = (ValueError, OSError)


class EngineCore:
    """The core's loop: apply the front's messages, step, send each step's new tokens."""

    def __init__(
        self, engine: LLMEngine, inbox: zmq.Socket, outboxes: list[zmq.Socket], front_fd: int
    ) -> None:
        """``outboxes``: one per front, by index; ``front_fd``: the read end of a pipe the
        starting process holds open, readable (end of file) once it is gone."""
        self.engine = engine
        self.inbox, self.outboxes, self.front_fd = inbox, outboxes, front_fd
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FrontMessage)
        self._poller = zmq.Poller()
        self._poller.register(inbox, zmq.POLLIN)
        self._poller.register(front_fd, zmq.POLLIN)
        self._live: dict[str, int] = {}  # request id: the index of the front that sent it
        self._deltas: list[list[RequestDelta]] = [[] for _ in outboxes]  # per front
        self._stats: EngineStats | None = None
        self._stats_time = 0.0
        self._adapters: dict[str, LoRARequest] = {}  # by name; ids are given here, from 1
        self._adapter_ids = 0
        engine.on_scheduled = self._publish_stats

    def send(self, message: CoreMessage, front: int | None = None) -> None:
        """To one front, or (None) to every front."""
        frame = self._encoder.encode(message)
        for outbox in self.outboxes if front is None else [self.outboxes[front]]:
            outbox.send(frame, copy=False)

    def run(self) -> None:
        try:
            while self._receive(self._poll_ms()):
                if self._steps():
                    self._step()
                elif self.engine.keeps_blocks():
                    self.engine.release_blocks()
                self._publish()
        finally:
            self.engine.on_scheduled = None  # its sockets close after this

    def _poll_ms(self) -> int:
        """How long to wait for messages: not at all while steps run; briefly while finished
        requests hold blocks (for another instance; or a load may still write them)."""
        if self._steps():
            return 0
        return HELD_POLL_MS if self.engine.keeps_blocks() else IDLE_POLL_MS

    def _steps(self) -> bool:
        """Whether there is a step to run (requests, and generation not paused)."""
        return self.engine.has_unfinished_requests() and not self.engine.rollout.paused

    def _receive(self, timeout_ms: int) -> bool:
        """Apply every waiting message; False once the core should exit."""
        events = dict(self._poller.poll(timeout_ms))
        if self.front_fd in events:
            log = logger.error if self._live else logger.info
            log("the process that started the engine core is gone; the core exits")
            return False
        while events:
            try:
                frame = self.inbox.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            message = self._decoder.decode(frame.buffer)
            if isinstance(message, AddRequest | AddPoolingRequest):
                self._add(message)
            elif isinstance(message, AbortRequest):
                self._abort(message.request_id, message.sample_index)
            elif isinstance(message, AddAdapter):
                self._add_adapter(message)
            elif isinstance(message, RemoveAdapter):
                removed = self._adapters.pop(message.lora_name, None)
                if removed is not None:
                    self.engine.remove_lora(removed.lora_int_id)
            elif isinstance(message, Control):
                self._control(message)
            else:
                assert isinstance(message, Shutdown)
                for request_id in list(self._live):
                    self._abort(request_id)
                self._publish()
                return False
        return True

    def _abort(self, request_id: str, sample_index: int | None = None) -> None:
        delta = self.engine.abort_request(request_id, sample_index)
        if delta is not None:
            self._queue(delta)

    def _add(self, message: AddRequest | AddPoolingRequest) -> None:
        request_id = message.request_id
        try:
            lora, images = None, ()
            if isinstance(message, AddRequest):
                lora, images = message.lora_request, tuple(i.item() for i in message.images)
            self.engine.add_request(
                request_id, message.prompt_token_ids, message.params, lora, images
            )
        except ValueError as e:
            self.send(Rejected(request_id, str(e)), message.front)
            return
        except RuntimeError as e:  # asleep, or paused
            self.send(Rejected(request_id, str(e), unavailable=True), message.front)
            return
        self._live[request_id] = message.front

    def _add_adapter(self, message: AddAdapter) -> None:
        """A name keeps its id while it is loaded (every front adding it gets the same);
        another path under a loaded name is refused."""
        name, path = message.lora_name, message.lora_path
        known = self._adapters.get(name)
        try:
            if known is not None and known.lora_path != path:
                raise ValueError(f"LoRA adapter {name!r} is already loaded from {known.lora_path}")
            if known is None:
                known = LoRARequest(name, self._adapter_ids + 1, path)
                self.engine.add_lora(known)
                self._adapter_ids += 1
                self._adapters[name] = known
        except ValueError as e:
            self.send(Rejected(message.call_id, str(e)), message.front)
            return
        self.send(AdapterAdded(message.call_id, known), message.front)

    def _control(self, message: Control) -> None:
        """Run a control call; the deltas of the requests it aborted go to their fronts."""
        rollout = self.engine.rollout
        try:
            if message.method not in CONTROL_METHODS:
                raise ValueError(f"unknown control method {message.method!r}")
            attribute = getattr(rollout, message.method)
            value = attribute(**message.arguments) if callable(attribute) else attribute
        except (ValueError, TypeError) as e:
            self.send(ControlDone(message.call_id, None, str(e), "invalid"), message.front)
            return
        except RuntimeError as e:
            self.send(ControlDone(message.call_id, None, str(e), "conflict"), message.front)
            return
        if isinstance(value, list):  # the final deltas of aborted requests
            for delta in value:
                self._queue(delta)
            value = len(value)
        self._publish()
        self.send(ControlDone(message.call_id, value), message.front)

    def _step(self) -> None:
        try:
            deltas = self.engine.step()
        except Exception as e:
            # The step may have left these requests half-updated; aborting them frees their
            # blocks and keeps the engine usable for the next requests.
            logger.exception("engine step failed; aborting %d requests", len(self._live))
            by_front: dict[int, list[str]] = {}
            for request_id, front in self._live.items():
                self.engine.abort_request(request_id)
                by_front.setdefault(front, []).append(request_id)
            self._live.clear()
            for front, request_ids in by_front.items():
                self.send(StepFailed(request_ids, f"the model step failed: {e!r}"), front)
            if isinstance(e, WorkerDiedError):
                raise  # no later step can run: the core exits, the fronts report it dead
            return
        for delta in deltas:
            self._queue(delta)

    def _queue(self, delta: RequestDelta) -> None:
        """Queue a delta for the front that sent its request."""
        front = self._live[delta.request_id]
        if delta.finished:
            del self._live[delta.request_id]
        self._deltas[front].append(delta)

    def _publish(self) -> None:
        """Send each front its queued deltas, with the engine's stats (to every front) when
        they changed and are due."""
        stats = self._due_stats()
        for front, deltas in enumerate(self._deltas):
            if deltas or stats is not None:
                self.send(StepOutputs(deltas, stats), front)
                self._deltas[front] = []

    def _publish_stats(self) -> None:
        """At a step's start: the stats, when they changed and are due."""
        stats = self._due_stats()
        if stats is not None:
            self.send(StepOutputs([], stats))

    def _due_stats(self) -> EngineStats | None:
        now = time.monotonic()
        idle = not self.engine.has_unfinished_requests()
        if not idle and now - self._stats_time < STATS_INTERVAL_S:
            return None
        stats = EngineStats.of(self.engine)
        if stats == self._stats:
            return None
        self._stats, self._stats_time = stats, now
        return stats


def run_engine_core(args: CoreArgs) -> int:
    """Build the engine, report ready (or why not), and serve the front until told to stop."""
    # Ctrl-C reaches the whole process group; the front decides how the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    context = zmq.Context()
    outboxes = []
    for front in args.fronts:
        outbox = context.socket(zmq.PUSH)
        outbox.setsockopt(zmq.SNDHWM, 0)  # as the fronts' sockets: never drop nor block
        outbox.connect(front.output_address)
        outboxes.append(outbox)
    inbox = context.socket(zmq.PULL)
    inbox.setsockopt(zmq.RCVHWM, 0)
    for front in args.fronts:
        inbox.connect(front.input_address)  # one queue, fair among the fronts
    try:
        core = _start(args, inbox, outboxes)
        if core is not None:
            try:
                core.run()
            finally:
                core.engine.shutdown()
    finally:
        # Linger, so the last outputs reach the fronts before the process ends.
        for outbox in outboxes:
            outbox.close(linger=5000)
        inbox.close(linger=0)
        context.term()
        # The sockets' directory: its maker removes it too, unless it was killed.
        remove_sockets(args.fronts[0])
    return 0 if core is not None else 1


def _start(args: CoreArgs, inbox: zmq.Socket, outboxes: list[zmq.Socket]) -> EngineCore | None:
    encoder = msgspec.msgpack.Encoder()
    try:
        if resolve_device(args.config.device).type == "cpu":
            set_server_cpu_threads()
        engine = LLMEngine(args.config)
    except Exception as e:
        if not isinstance(e, _USER_ERRORS):
            logger.exception("the engine core failed to start")
        failed = encoder.encode(StartupFailed(str(e) or type(e).__name__))
        for outbox in outboxes:
            outbox.send(failed)
        return None
    core = EngineCore(engine, inbox, outboxes, sys.stdin.fileno())
    mc, connector = engine.model_config, engine.scheduler.connector
    freeze_start_up_heap()
    core.send(
        Ready(
            str(mc.path),
            str(args.config.tokenizer or mc.path),
            mc.max_model_len,
            sorted(engine.eos_token_ids),
            _describe(engine),
            EngineStats.of(engine),
            engine.pooling,
            args.config.enable_sleep_mode,
            (args.config.limit_mm_per_prompt or {}).get("image"),
            None if connector is None else connector.handshake(),
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
