"""LLMEngine: requests in, token deltas out, one step at a time (texts and stop strings are
the output processor's, :mod:`heron.engine.output_processor`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from heron.config import EngineConfig
from heron.engine.builder import build_engine
from heron.engine.deltas import RequestDelta, SampleDelta
from heron.engine.request import FinishReason, Request, RequestStatus
from heron.engine.resolved_config import resolve
from heron.engine.rollout import RolloutControl
from heron.engine.stopping import check_stop
from heron.execution.model_runner import LaunchedStep
from heron.execution.sampler import on_device
from heron.execution.step_plan import StepOutput
from heron.lora.request import LoRARequest
from heron.multimodal.architectures import accepts_images
from heron.multimodal.inputs import ImageItem
from heron.outputs import Logprob
from heron.pooling_params import PoolingParams
from heron.sampling_params import SamplingParams
from heron.speculative import SpecDecodeStats

if TYPE_CHECKING:
    import torch

    from heron.structured.grammar import GrammarCompiler

logger = logging.getLogger(__name__)

# How long an idle step waits for a grammar being compiled before it looks at its commands.
_GRAMMAR_WAIT_S = 0.02


@dataclass(frozen=True)
class _Launched:
    """A launched step and the requests of its sampled rows, in the runner's row order."""

    launched: LaunchedStep
    sample_requests: list[Request]
    num_proposed: list[int] | None = None  # per sampled row, in a verification step

    @property
    def num_pending(self) -> list[int]:
        """The tokens each sampled row may add (all its proposals accepted, and one more)."""
        if self.num_proposed is None:
            return [1] * len(self.sample_requests)
        return [1 + n for n in self.num_proposed]


@dataclass(eq=False)
class _UserRequest:
    """A user request's ``n`` samples, and whether its first delta was sent."""

    request_id: str
    children: list[Request]
    reported: bool = False


class LLMEngine:
    """Continuous-batching engine over a paged KV cache (synchronous; one ``step`` at a time)."""

    def __init__(self, config: EngineConfig) -> None:
        self.resolved = resolve(config)
        self.config = config
        self.platform = self.resolved.platform
        self.model_config = self.resolved.model
        self.pooling = self.resolved.pooling  # a pooling model's pooler; None: it generates
        self.max_num_batched_tokens = self.resolved.max_num_batched_tokens
        self.block_size = self.resolved.block_size
        parts = build_engine(self.resolved)
        self.tokenizer = parts.tokenizer
        self.runner, self.draft_runner = parts.runner, parts.draft_runner
        self.kv_cache, self.scheduler = parts.kv_cache, parts.scheduler
        self.proposer, self.speculator = parts.proposer, parts.speculator
        self.verification_bytes = parts.verification_bytes
        self.sync_verification_reason = parts.sync_verification_reason
        self.spec_decode_stats = SpecDecodeStats()
        # Called once each step's requests are scheduled, before the model runs (the server
        # sends its gauges then, so they show what a long step runs while it runs).
        self.on_scheduled: Callable[[], None] | None = None
        self._parents: dict[str, _UserRequest] = {}
        self._in_flight: _Launched | None = None  # launched, its tokens not read yet
        self._grammars: GrammarCompiler | None = None  # made for the first structured request
        self.eos_token_ids = self.model_config.eos_token_ids | (
            {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        )
        # Sleep and wake-up, weight updates, pause and resume.
        self.rollout = RolloutControl(self)

    def shutdown(self) -> None:
        """Stop what runs beside this process: the tensor-parallel workers, if any; leave a
        trainer's weight update group; free the blocks a KV connector's transfers hold."""
        self.rollout.close_weight_update_group()
        self.runner.shutdown()
        self.scheduler.stop_transfers()

    # ----------------------------------------------------------------- requests

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
        images: tuple[ImageItem, ...] = (),
    ) -> None:
        """Queue a request (under ``lora_request``'s adapter, if given; a pooling request with
        ``PoolingParams``; ``images``: the prompt's, from :class:`ImageProcessor`, whose
        placeholders it holds already); raise ``ValueError`` (and queue nothing) if it is
        invalid. Every
        step that advances a generation returns its delta; a pooling request's one delta
        comes once it is pooled."""
        self.rollout.check_accepts_requests()
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.pooling is not None or isinstance(params, PoolingParams):
            if lora_request is not None:
                raise ValueError("lora_request: pooling requests run no LoRA adapter")
            self._add_pooling_request(request_id, list(prompt_token_ids), params)
            return
        if lora_request is not None:
            self.add_lora(lora_request)
        params = (params or SamplingParams()).clone()
        params.eos_token_ids = frozenset(self.eos_token_ids)
        token_ids = list(prompt_token_ids)
        self._validate_prompt(token_ids)
        if images:
            self.validate_images(len(images))
            self._check_whole_images(images)
        if params.kv_transfer_params is not None:
            if self.scheduler.connector is None:
                raise ValueError(
                    "kv_transfer_params: this instance runs no KV connector (kv_transfer_config)"
                )
            self.scheduler.connector.check_params(params.kv_transfer_params, len(token_ids))
        vocab = self.model_config.vocab_size
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(
                f"logit_bias token id {max(params.logit_bias)} is outside the vocabulary "
                f"[0, {vocab})"
            )
        children = []
        for index in range(params.n):
            child = Request(
                f"{request_id}-{index}" if params.n > 1 else request_id,
                token_ids,
                params,
                parent_id=request_id,
                sample_index=index,
                lora_request=lora_request,
                images=images,
            )
            children.append(child)
        if params.structured_outputs is not None:
            grammars = self._grammar_compiler().request_grammars(
                params.structured_outputs, params.n
            )
            for child, grammar in zip(children, grammars):
                child.grammar = grammar
        self._parents[request_id] = _UserRequest(request_id, children)
        for child in children:
            self.scheduler.add(child)

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Read and check an adapter now (requests naming it later start without reading
        it); ``ValueError`` naming what does not fit."""
        self.runner.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> None:
        """Forget an adapter (a request still naming it has it read again)."""
        self.runner.remove_lora(lora_int_id)

    def _add_pooling_request(
        self, request_id: str, token_ids: list[int], params: PoolingParams | None
    ) -> None:
        self.check_pooling_params(params)
        self._validate_prompt(token_ids)
        # It samples nothing: its sampling parameters are the defaults, never read.
        request = Request(request_id, token_ids, SamplingParams(), pooling_params=params)
        self._parents[request_id] = _UserRequest(request_id, [request])
        self.scheduler.add(request)

    def check_pooling_params(self, params: PoolingParams | SamplingParams | None) -> None:
        """Raise ``ValueError`` unless this is a pooling model that serves ``params``."""
        pooling = self.pooling
        if pooling is None:
            raise ValueError(
                "this model generates text: pooling requests need a pooling model "
                "(runner='pooling')"
            )
        if not isinstance(params, PoolingParams):
            raise ValueError(
                f"this is a pooling model ({self.model_config.architecture}); it does not "
                f"generate text: send pooling requests ({', '.join(pooling.tasks)})"
            )
        pooling.check(params)

    def _grammar_compiler(self) -> GrammarCompiler:
        if self._grammars is None:
            # xgrammar is imported only by an engine that sees a grammar.
            from heron.structured.grammar import GrammarCompiler

            self._grammars = GrammarCompiler(
                self.tokenizer, self.model_config.vocab_size, self.eos_token_ids
            )
        return self._grammars

    def validate_images(self, count: int) -> None:
        """``ValueError`` unless the model reads images and a prompt may hold ``count``."""
        architecture = self.model_config.architecture
        if not accepts_images(architecture):
            raise ValueError(f"{architecture} is a text-only model: it takes no images")
        config = self.config
        unsupported = [
            ("speculative_config", config.speculative_config is not None),
            ("tensor_parallel_size > 1", config.tensor_parallel_size > 1),
            ("a KV connector", self.scheduler.connector is not None),
        ]
        for name, used in unsupported:
            if used:
                raise ValueError(f"images are not supported with {name} yet")
        limit = (self.config.limit_mm_per_prompt or {}).get("image")
        if limit is not None and count > limit:
            raise ValueError(
                f"the prompt has {count} images, more than limit_mm_per_prompt allows ({limit})"
            )

    def _check_whole_images(self, images: tuple[ImageItem, ...]) -> None:
        """``ValueError`` for an image one step cannot hold, where a step must hold an image's
        every token (its tokens attend to the whole image)."""
        config = self.scheduler.config
        longest = max(item.length for item in images)
        if config.whole_images and longest > config.max_num_batched_tokens:
            raise ValueError(
                f"an image of {longest} tokens does not fit one step (max_num_batched_tokens="
                f"{config.max_num_batched_tokens}); this model's image tokens attend to their "
                "whole image, so one step computes all of them"
            )

    def _validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty")
        max_len = self.model_config.max_model_len
        if len(token_ids) > max_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, more than the context length "
                f"(max_model_len={max_len})"
            )
        vocab = self.model_config.vocab_size
        bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")

    def abort_request(
        self, request_id: str, sample_index: int | None = None
    ) -> RequestDelta | None:
        """Stop a request, or only its sample ``sample_index``, now; the blocks return to the
        pool. Returns the delta saying so (None for an unknown id)."""
        parent = self._parents.get(request_id)
        if parent is None:
            return None
        delta = RequestDelta(request_id, [], False, 0)
        for child in parent.children:
            if not child.is_finished and sample_index in (None, child.sample_index):
                child.finish(FinishReason.ABORT)
                self.scheduler.remove(child)
                delta.samples.append(
                    SampleDelta(child.sample_index, [], None, FinishReason.ABORT.value, None)
                )
        return self._complete(parent, delta)

    def release_blocks(self) -> None:
        """Free finished requests' blocks a KV connector is done with: held for another
        instance (read, or past the timeout), or aborted while a load was writing them."""
        if self.scheduler.draining:
            self._collect_transfers()
        if self.scheduler.held:
            self.scheduler.release_held()

    def keeps_blocks(self) -> bool:
        """Whether finished requests hold blocks (see :meth:`release_blocks`)."""
        return bool(self.scheduler.held or self.scheduler.draining)

    def samples(self, request_id: str) -> list[Request]:
        """The sequences (one per sample) of an unfinished user request."""
        return self._parents[request_id].children

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    def unfinished_request_ids(self) -> list[str]:
        return list(self._parents)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._parents)

    # ----------------------------------------------------------------- the step

    def settle(self) -> list[RequestDelta]:
        """Read the step in flight (the deltas it adds); with no request left, bring the
        runners (and a proposer's) up to the finished ones too, so none holds a row."""
        previous, self._in_flight = self._in_flight, None
        touched: dict[str, RequestDelta] = {}
        if previous is not None:
            self._read(previous, touched)
        deltas = [self._complete(self._parents[i], delta) for i, delta in touched.items()]
        if not self._parents:
            self._step()  # (a plan of the finished requests only)
            if self.proposer is not None:
                self.proposer.settle()
        return deltas

    def step(self) -> list[RequestDelta]:
        """Run one step (none while generation is paused): see :meth:`_step`."""
        return [] if self.rollout.paused else self._step()

    def _step(self) -> list[RequestDelta]:
        """Run one step; return what it added to every user request it advanced: the new
        tokens of each sample, and its finish (texts and stop strings are the caller's:
        :class:`heron.engine.output_processor.OutputProcessor`).

        With asynchronous scheduling (the default) a step whose tokens stay on the device is
        read one call later: this call schedules and launches the next step first, so the host's
        work (scheduling, inputs, stop checks, the caller's outputs) overlaps the device's. A step
        that samples grammar rows reads the previous step before it is launched (only its
        scheduling overlaps), since each grammar must see its last token before the next mask.
        With speculative decoding a step in flight is read before scheduling whenever this
        pass would make proposals (they start from the last token), unless it is a verification
        left on the device (a draft model's, where every operator reads lengths on the device):
        the pass then runs past it as if it accepted every proposal, the runner moves the rows
        back by its refusals on the device, and reading it rolls the host back
        (:meth:`_read_verified`).
        """
        previous, self._in_flight = self._in_flight, None
        touched: dict[str, RequestDelta] = {}
        failed: list[tuple[Request, str]] = []
        if previous is not None and not self._runs_past(previous.launched):
            # Proposals start from the last token: read it before scheduling.
            self._read(previous, touched)
            previous = None
        verifying = previous.launched if previous and previous.launched.rollback else None
        proposals = None
        if self.speculator is not None:
            proposals = self.speculator.propose(self.scheduler.running, verifying)
        schedule = self.scheduler.schedule(proposals)
        if self.on_scheduled is not None:
            self.on_scheduled()
        plan = schedule.plan
        launched = None
        if plan.has_work:
            sample_requests = [i.request for i in schedule.scheduled if i.samples]
            if any(r.grammar is not None for r in sample_requests):
                if previous is not None and any(
                    r.grammar is not None and r.num_pending_tokens for r in sample_requests
                ):
                    # The masks need the tokens the previous step sampled: wait for them here.
                    self._read(previous, touched)
                    previous = None
                plan = replace(plan, token_bitmask=self._token_bitmask(sample_requests))
            previous_step = previous.launched if previous else None
            step = self.runner.launch(plan, previous_step, schedule.drafts)
            if step.hidden_states is not None and self._proposes:
                # (while the batch is too large to propose, the head is not fed)
                self.proposer.take_hidden_states(
                    plan.request_ids, plan.num_computed, plan.num_new, step.hidden_states
                )
            launched = _Launched(
                step,
                sample_requests,
                [plan.num_proposed(r.request_id) for r in sample_requests]
                if plan.verifies
                else None,
            )
            self.scheduler.finish_step(schedule)
            if self.scheduler.connector is not None:
                failed = self._collect_transfers()
            for request, n in zip(launched.sample_requests, launched.num_pending):
                request.num_pending_tokens += n
        elif self.scheduler.loading or self.scheduler.draining:  # (loads outlasting a step)
            failed = self._collect_transfers()
        if previous is not None:
            self._read(previous, touched)
        if launched is not None:
            if self.config.async_scheduling and not launched.launched.is_ready:
                self._in_flight = launched
            else:
                self._read(launched, touched)
        elif previous is None:
            compiling = [r.grammar for r in self.scheduler.waiting if r.waits_for_grammar]
            if compiling:
                self._grammars.wait_for_any(compiling, _GRAMMAR_WAIT_S)

        deltas = [self._complete(self._parents[i], delta) for i, delta in touched.items()]
        return deltas + self._fail(schedule.failed + failed)

    def _fail(self, failed: list[tuple[Request, str]]) -> list[RequestDelta]:
        """Abort the user requests of ``failed`` samples; their final deltas say why."""
        deltas = []
        for request, error in failed:
            delta = self.abort_request(request.parent_id)
            if delta is not None:  # (None: a sibling's failure aborted it already)
                delta.error = error
                deltas.append(delta)
        return deltas

    def _complete(self, parent: _UserRequest, delta: RequestDelta) -> RequestDelta:
        """Fill in what a delta says of the whole request; forget the request once finished."""
        first = parent.children[0]
        # (the last child first: while a request runs, one look settles it)
        delta.finished = parent.children[-1].is_finished and all(
            c.is_finished for c in parent.children
        )
        delta.num_cached_tokens = first.num_cached_tokens
        if not parent.reported:
            parent.reported = True
            if first.wants_prompt_logprobs:
                delta.prompt_logprobs = list(first.prompt_logprobs)
            scheduled = [c.first_scheduled_time for c in parent.children]
            delta.first_scheduled_time = min((t for t in scheduled if t is not None), default=None)
        if delta.finished:
            delta.kv_transfer_params = first.kv_transfer_params
            del self._parents[parent.request_id]
        return delta

    def _runs_past(self, launched: LaunchedStep) -> bool:
        """Whether the next step may be scheduled before ``launched`` is read: while nothing is
        proposed (its pending tokens are fed on the device), or past a verification left on
        the device while every running request samples on the device (none waits for its
        tokens on the host: grammar, penalties, logprobs, ``min_tokens``)."""
        if launched.rollback is None:
            return not self._proposes
        return all(r.grammar is None and on_device(r) for r in self.scheduler.running)

    @property
    def _proposes(self) -> bool:
        """Whether this pass makes proposals (speculation on, the batch small enough)."""
        return self.speculator is not None and self.speculator.proposes(len(self.scheduler.running))

    def _token_bitmask(self, sample_requests: list[Request]) -> torch.Tensor:
        """The sampled rows' grammar masks; a request that finished when the previous step was
        read (its token will be dropped) is left free."""
        grammars = [None if r.is_finished else r.grammar for r in sample_requests]
        return self._grammars.token_bitmask(grammars)

    def _collect_transfers(self) -> list[tuple[Request, str]]:
        """Hand the KV connector's ended transfers to the scheduler (the requests it fails, as
        :meth:`Scheduler.transfers_finished`); a connector that raises is switched off, never
        the engine."""
        try:
            results = self.runner.take_transfer_results()
        except Exception:
            logger.exception("KV connector failed: the engine runs on without it")
            self.scheduler.stop_transfers()
            return []
        return self.scheduler.transfers_finished(results)

    def _read(self, launched: _Launched, touched: dict[str, RequestDelta]) -> None:
        """Apply a step's sampled tokens (and prompt logprobs) to its requests."""
        result = launched.launched.result()
        now = time.monotonic()
        requests = launched.sample_requests
        for request, n in zip(requests, launched.num_pending):
            request.num_pending_tokens -= n
        if result.prompt_logprobs:
            by_id = {r.request_id: r for r in self.scheduler.running}
            for request_id, lps in result.prompt_logprobs.items():
                request = by_id.get(request_id)
                if request is None:
                    continue  # aborted since
                if not request.prompt_logprobs:
                    request.prompt_logprobs.append(None)  # the first token has no context
                request.prompt_logprobs.extend(lps)
        if launched.num_proposed is not None:
            self._read_verified(launched, result, touched, now)
            return
        if self.pooling is not None:
            self._read_pooled(requests, result, touched, now)
            return
        for request, token_id, logprob in zip(requests, result.token_ids, result.logprobs):
            if request.status is RequestStatus.FINISHED:
                continue  # stopped or aborted while this step ran: the token is dropped
            self._append(request, token_id, logprob, now, touched)

    def _read_pooled(
        self,
        requests: list[Request],
        result: StepOutput,
        touched: dict[str, RequestDelta],
        now: float,
    ) -> None:
        """A pooling step's outputs: each request whose last token it computed finishes with
        its answer (one that was aborted meanwhile is dropped)."""
        for request in requests:
            if request.status is RequestStatus.FINISHED:
                continue
            request.first_token_time = now
            request.finish(FinishReason.STOP)
            self.scheduler.remove(request)
            pooled = request.pooling_params.finish(
                result.pooled[request.request_id], self.pooling.normalize
            )
            touched[request.parent_id] = RequestDelta(
                request.parent_id, [], False, 0, pooled=pooled
            )

    def _read_verified(
        self,
        launched: _Launched,
        result: StepOutput,
        touched: dict[str, RequestDelta],
        now: float,
    ) -> None:
        """A verification step's tokens: refused proposals are rolled back first (so a request
        that finishes on one of its tokens frees only what it holds), then each row's tokens
        are appended until one ends the request. A request that finished since (its tokens
        are dropped) or was preempted (its blocks are gone) is not rolled back."""
        rows = zip(
            launched.sample_requests, result.row_token_ids(), result.logprobs, launched.num_proposed
        )
        for request, tokens, logprob, num_proposed in rows:
            if num_proposed and request.status is not RequestStatus.FINISHED:
                self.spec_decode_stats.record(num_proposed, len(tokens) - 1)
                if request.status is RequestStatus.RUNNING:
                    self.scheduler.reject(request, num_proposed - (len(tokens) - 1))
            for token_id in tokens:
                if request.status is RequestStatus.FINISHED:
                    break  # the tokens after the one that ended it are dropped
                self._append(request, token_id, logprob, now, touched)

    def _append(
        self,
        request: Request,
        token_id: int,
        logprob: Logprob | None,
        now: float,
        touched: dict[str, RequestDelta],
    ) -> None:
        """One new token of a running request: its delta, stop checks (stop strings are the
        caller's), grammar."""
        sample = self._sample_delta(request, touched)
        request.append_output_token(token_id)
        sample.token_ids.append(token_id)
        if logprob is not None:
            request.logprobs.append(logprob)
            sample.logprobs.append(logprob)
        if request.first_token_time is None:
            request.first_token_time = now
        stop = check_stop(request, token_id, None, self.model_config.max_model_len)
        if request.grammar is not None and not request.grammar.accept(token_id):
            # a grammar that failed to compile, or a token it refuses (logged by accept)
            stop = (FinishReason.ABORT, None)
        if stop is not None:
            request.finish(*stop)
            sample.finish_reason, sample.stop_reason = stop[0].value, stop[1]
            self.scheduler.remove(request)

    @staticmethod
    def _sample_delta(request: Request, touched: dict[str, RequestDelta]) -> SampleDelta:
        """This step's delta of ``request``'s sample, made on its first token."""
        delta = touched.get(request.parent_id)
        if delta is not None:
            for sample in delta.samples:  # (``n`` of them at most)
                if sample.index == request.sample_index:
                    return sample
        wants_logprobs = request.sampling_params.logprobs is not None
        sample = SampleDelta(request.sample_index, [], [] if wants_logprobs else None, None, None)
        if delta is None:
            touched[request.parent_id] = RequestDelta(request.parent_id, [sample], False, 0)
        else:
            delta.samples.append(sample)
        return sample
