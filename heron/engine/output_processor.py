"""The one output path: the engine's token deltas become :class:`RequestOutput`\\ s.

The engine reports each step's new tokens per sample (:class:`RequestDelta`), in this process
for :class:`heron.LLM` or from the engine core process for the server's front. Both feed them
here: the samples' tokens are kept, detokenised and watched for stop strings, and one output
per request is assembled. A stop string ends a sample here while the engine may still run it;
:meth:`OutputProcessor.process` returns those samples for the caller to abort in the engine.
This module imports no model code: a front process runs it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from heron.engine.deltas import RequestDelta, SampleDelta
from heron.engine.detokenizer import IncrementalDetokenizer
from heron.engine.messages import AbortRequest
from heron.outputs import CompletionOutput, Logprob, PrefixView, RequestOutput
from heron.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(eq=False)
class _Sample:
    detokenizer: IncrementalDetokenizer
    logprobs: list[Logprob] | None  # None: not asked for
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def output(self, index: int) -> CompletionOutput:
        detokenizer, logprobs = self.detokenizer, self.logprobs
        if self.finish_reason is not None:
            return CompletionOutput(
                index,
                detokenizer.text,
                list(self.token_ids),
                self.finish_reason,
                self.stop_reason,
                None if logprobs is None else list(logprobs),
            )
        # (a streamed output views the growing lists instead of copying them every step)
        return CompletionOutput(
            index,
            detokenizer.text_safe_to_stream,
            PrefixView(self.token_ids),
            None,
            None,
            None if logprobs is None else PrefixView(logprobs),
        )

    def apply(self, delta: SampleDelta) -> bool:
        """Take the sample's new tokens up to a stop string; True if a stop string ended a
        sample the engine still runs."""
        detokenizer, token_ids, logprobs = self.detokenizer, self.token_ids, self.logprobs
        for i, token_id in enumerate(delta.token_ids):
            token_ids.append(token_id)
            if logprobs is not None:
                logprobs.append(delta.logprobs[i])
            stop_string = detokenizer.append(token_id)
            if stop_string is not None:
                self.finish("stop", stop_string)
                return delta.finish_reason is None  # (the tokens after it are dropped)
        if delta.finish_reason is not None:
            self.finish(delta.finish_reason, delta.stop_reason)
        return False

    def finish(self, reason: str, stop_reason: str | int | None) -> None:
        self.finish_reason, self.stop_reason = reason, stop_reason
        self.detokenizer.finish()


@dataclass(eq=False)
class _RequestState:
    """A user request's outputs so far, one :class:`_Sample` per sample."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[_Sample]
    stream: bool  # an output every step that advances it, or only the finished one
    prompt_logprobs: list[Logprob | None] | None  # None: not asked for
    arrival_time: float = field(default_factory=time.monotonic)
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    kv_transfer_params: dict | None = None
    error: str | None = None  # why it failed (with its final delta)

    @property
    def finished(self) -> bool:
        for sample in self.samples:  # (a loop: once per request and step, kept cheap)
            if sample.finish_reason is None:
                return False
        return True

    def output(self, finished: bool) -> RequestOutput:
        samples = self.samples
        output = RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            [samples[0].output(0)]
            if len(samples) == 1
            else [sample.output(index) for index, sample in enumerate(samples)],
            finished,
            None if self.prompt_logprobs is None else list(self.prompt_logprobs),
            self.num_cached_tokens,
        )
        if finished:
            output.metrics = self.timings()
            output.kv_transfer_params = self.kv_transfer_params
            output.error = self.error
        return output

    def timings(self) -> dict[str, float]:
        """Monotonic timestamps of the finished request, over all its samples."""
        timings = {"arrival_time": self.arrival_time, "finished_time": time.monotonic()}
        if self.first_scheduled_time is not None:
            timings["first_scheduled_time"] = self.first_scheduled_time
        if self.first_token_time is not None:
            timings["first_token_time"] = self.first_token_time
        return timings


@dataclass(frozen=True)
class ProcessedOutputs:
    outputs: list[RequestOutput]  # one per request the deltas advanced (and that wants one)
    aborts: list[AbortRequest]  # samples a stop string ended that the engine still runs


class OutputProcessor:
    """Every unfinished request's outputs, fed by the engine's deltas."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_token_ids: Iterable[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self._requests: dict[str, _RequestState] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        stream: bool = True,
    ) -> None:
        """Track a request the engine accepted (``prompt``: its text, if it came as text)."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = params.clone()
        params.eos_token_ids = self.eos_token_ids  # the detokenizer leaves EOS text out
        wants_logprobs = params.logprobs is not None
        samples = [
            _Sample(
                IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params),
                [] if wants_logprobs else None,
            )
            for _ in range(params.n)
        ]
        self._requests[request_id] = _RequestState(
            request_id,
            prompt,
            prompt_token_ids,
            samples,
            stream,
            [] if params.prompt_logprobs is not None else None,
        )

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def abort(self, request_id: str) -> None:
        """Forget a request (aborted, failed or rejected); unknown ids are ignored."""
        self._requests.pop(request_id, None)

    def process(self, deltas: Sequence[RequestDelta]) -> ProcessedOutputs:
        """Apply deltas (of one step or several); one output per request however many deltas
        it had. Deltas of requests no longer tracked (finished here by a stop string,
        aborted) are dropped."""
        now = time.monotonic()
        touched: dict[str, _RequestState] = {}
        aborts: list[AbortRequest] = []
        for delta in deltas:
            state = self._requests.get(delta.request_id)
            if state is None:
                continue
            touched[delta.request_id] = state
            stopped = self._apply(state, delta, now)
            if not stopped:
                continue
            if state.finished:
                aborts.append(AbortRequest(delta.request_id))
            else:
                aborts.extend(AbortRequest(delta.request_id, index) for index in stopped)
        outputs = []
        for request_id, state in touched.items():
            finished = state.finished
            if finished:
                del self._requests[request_id]
            if finished or state.stream:
                outputs.append(state.output(finished))
        return ProcessedOutputs(outputs, aborts)

    @staticmethod
    def _apply(state: _RequestState, delta: RequestDelta, now: float) -> list[int]:
        """Apply one delta; the samples a stop string ended that still run in the engine."""
        state.num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs is not None and state.prompt_logprobs is not None:
            state.prompt_logprobs = delta.prompt_logprobs
        if delta.first_scheduled_time is not None:
            state.first_scheduled_time = delta.first_scheduled_time
        if delta.kv_transfer_params is not None:
            state.kv_transfer_params = delta.kv_transfer_params
        if delta.error is not None:
            state.error = delta.error
        stopped = []
        for sample_delta in delta.samples:
            sample = state.samples[sample_delta.index]
            if sample.finish_reason is not None:
                continue  # stopped here by a stop string: the engine's tokens since are dropped
            if state.first_token_time is None and sample_delta.token_ids:
                state.first_token_time = now
            if sample.apply(sample_delta):
                stopped.append(sample_delta.index)
        return stopped
