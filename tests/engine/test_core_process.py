"""EngineCore's protocol, in this process over inproc ZMQ sockets: token deltas, rejection,
one sample's abort, a failed step, shutdown, and the front's death."""

from __future__ import annotations

import os
import threading

import msgspec
import pytest
import zmq

from heron.config import EngineConfig
from heron.engine.core_process import EngineCore
from heron.engine.deltas import RequestDelta
from heron.engine.llm_engine import LLMEngine
from heron.engine.messages import (
    AbortRequest,
    AddRequest,
    CoreMessage,
    Rejected,
    Shutdown,
    StepFailed,
    StepOutputs,
)
from heron.engine.output_processor import OutputProcessor
from heron.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    config = EngineConfig(str(tiny_model_dir("qwen2")), max_model_len=128, num_kv_blocks=40)
    return LLMEngine(config)


class Front:
    """The front's ends of the core's sockets and pipe; the core runs in a thread."""

    def __init__(self, engine: LLMEngine) -> None:
        self.context = zmq.Context()
        self.to_core = self.context.socket(zmq.PUSH)
        self.to_core.bind("inproc://in")
        self.from_core = self.context.socket(zmq.PULL)
        self.from_core.bind("inproc://out")
        inbox, outbox = self.context.socket(zmq.PULL), self.context.socket(zmq.PUSH)
        inbox.connect("inproc://in")
        outbox.connect("inproc://out")
        self.pipe_read, self.pipe_write = os.pipe()
        self.core = EngineCore(engine, inbox, [outbox], self.pipe_read)
        self.thread = threading.Thread(target=self.core.run)
        self.thread.start()
        self.decoder = msgspec.msgpack.Decoder(CoreMessage)

    def send(self, message) -> None:
        self.to_core.send(msgspec.msgpack.encode(message))

    def receive(self) -> CoreMessage:
        assert self.from_core.poll(30_000), "the core sent nothing"
        return self.decoder.decode(self.from_core.recv())

    def deltas_until_finished(self, request_id: str) -> list[RequestDelta]:
        deltas = []
        while not (deltas and deltas[-1].finished):
            message = self.receive()
            if isinstance(message, StepOutputs):
                deltas += [d for d in message.deltas if d.request_id == request_id]
        return deltas

    def close(self) -> None:
        if self.context.closed:
            return
        if self.thread.is_alive():
            self.send(Shutdown())
        self.thread.join(30)
        assert not self.thread.is_alive()
        for socket in (self.to_core, self.from_core, self.core.inbox, *self.core.outboxes):
            socket.close(linger=0)
        self.context.term()
        os.close(self.pipe_read)
        if self.pipe_write is not None:
            os.close(self.pipe_write)


@pytest.fixture
def front(engine):
    handle = Front(engine)
    yield handle
    handle.close()
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks - 1


def _tokens(deltas: list[RequestDelta], index: int = 0) -> list[int]:
    return [t for d in deltas for s in d.samples if s.index == index for t in s.token_ids]


def test_deltas_add_up_to_the_in_process_output(front, engine):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    front.send(AddRequest("a", [5, 6, 7, 8], params))
    deltas = front.deltas_until_finished("a")
    assert deltas[0].first_scheduled_time is not None
    logprobs = [lp for d in deltas for s in d.samples for lp in s.logprobs]
    assert deltas[-1].samples[-1].finish_reason == "length"
    front.close()  # the same engine, stepped directly, its deltas processed as LLM does
    processor = OutputProcessor(engine.tokenizer, engine.eos_token_ids)
    engine.add_request("b", [5, 6, 7, 8], params)
    processor.add_request("b", None, [5, 6, 7, 8], params, stream=False)
    outputs = (processor.process(engine.step()).outputs for _ in range(20))
    (output,) = [o for step in outputs for o in step if o.finished][:1]
    assert _tokens(deltas) == list(output.outputs[0].token_ids)
    assert logprobs == list(output.outputs[0].logprobs)


def test_stats_go_out_when_a_step_starts(front):
    """Before the step's tokens, the fronts learn what it runs (a long step would otherwise
    show the engine idle while it runs)."""
    front.send(AddRequest("a", [5, 6, 7, 8], SamplingParams(max_tokens=1)))
    message = front.receive()
    while message.stats is None or message.stats.num_requests_running == 0:
        assert not message.deltas  # the step's tokens come after
        message = front.receive()
    assert message.deltas == [] and message.stats.num_requests_running == 1
    assert message.stats.kv_cache_free_blocks < message.stats.kv_cache_total_blocks
    assert front.deltas_until_finished("a")[-1].finished


def test_invalid_request_is_rejected(front):
    front.send(AddRequest("empty", [], SamplingParams()))
    message = front.receive()
    assert isinstance(message, Rejected) and "empty" in message.message


def test_abort_one_sample(front):
    params = SamplingParams(n=2, temperature=0, max_tokens=40, ignore_eos=True)
    front.send(AddRequest("n2", [5, 6, 7], params))
    front.receive()  # the first step's delta
    front.send(AbortRequest("n2", 0))
    deltas = front.deltas_until_finished("n2")
    reasons = {s.index: s.finish_reason for d in deltas for s in d.samples if s.finish_reason}
    assert reasons == {0: "abort", 1: "length"}
    assert len(_tokens(deltas, 0)) < 40


def test_failed_step_aborts_its_requests_and_the_core_goes_on(front, engine, monkeypatch):
    def fail(*args):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "launch", fail)
    front.send(AddRequest("doomed", [5, 6, 7], SamplingParams(max_tokens=3)))
    message = front.receive()
    while isinstance(message, StepOutputs) and not message.deltas:
        message = front.receive()  # the stats at the step's start
    assert isinstance(message, StepFailed) and message.request_ids == ["doomed"]
    assert "device lost" in message.message
    monkeypatch.undo()
    front.send(AddRequest("fine", [5, 6, 7], SamplingParams(max_tokens=3)))
    assert len(_tokens(front.deltas_until_finished("fine"))) == 3


def test_shutdown_aborts_what_runs(front):
    front.send(AddRequest("long", [5, 6, 7], SamplingParams(max_tokens=100, ignore_eos=True)))
    front.receive()
    front.send(Shutdown())
    deltas = front.deltas_until_finished("long")
    assert deltas[-1].samples[-1].finish_reason == "abort"
    front.thread.join(10)
    assert not front.thread.is_alive()


def test_the_front_gone_ends_the_core(front):
    front.send(AddRequest("long", [5, 6, 7], SamplingParams(max_tokens=100, ignore_eos=True)))
    front.receive()
    os.close(front.pipe_write)
    front.pipe_write = None
    front.thread.join(10)
    assert not front.thread.is_alive()
    front.core.engine.abort_request("long")  # what the process's exit would have freed
