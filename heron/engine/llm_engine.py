"""LLMEngine: requests in, outputs out, one step at a time."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from heron.config import EngineConfig
from heron.engine.builder import build_engine
from heron.engine.detokenizer import IncrementalDetokenizer
from heron.engine.request import FinishReason, Request, RequestStatus
from heron.engine.resolved_config import resolve
from heron.engine.stopping import check_stop
from heron.execution.model_runner import LaunchedStep
from heron.execution.sampler import on_device
from heron.execution.step_plan import StepOutput
from heron.outputs import CompletionOutput, Logprob, PrefixView, RequestOutput
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
class ParentRequest:
    """A user request and its ``n`` samples (with a detokenizer each, or none: an engine core
    whose front detokenizes)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    detokenizers: list[IncrementalDetokenizer]
    stream: bool  # report every step, or only when finished
    arrival_time: float = field(default_factory=time.monotonic)

    def output(self) -> RequestOutput:
        outputs = []
        all_finished = True
        for child in self.children:
            finished = child.status is RequestStatus.FINISHED
            all_finished &= finished
            snapshot = list if finished else PrefixView
            detok = self.detokenizers[child.sample_index] if self.detokenizers else None
            outputs.append(
                CompletionOutput(
                    child.sample_index,
                    "" if detok is None else detok.text if finished else detok.text_safe_to_stream,
                    snapshot(child.output_token_ids),
                    child.finish_reason.value if child.finish_reason else None,
                    child.stop_reason,
                    snapshot(child.logprobs)
                    if child.sampling_params.logprobs is not None
                    else None,
                )
            )
        first = self.children[0]
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            outputs,
            all_finished,
            list(first.prompt_logprobs) if first.wants_prompt_logprobs else None,
            first.num_cached_tokens,
        )


class LLMEngine:
    """Continuous-batching engine over a paged KV cache (synchronous; one ``step`` at a time)."""

    def __init__(self, config: EngineConfig, detokenize: bool = True) -> None:
        """Without ``detokenize`` outputs have no text and stop strings are not looked for:
        the caller (the server's front process) does both."""
        self.resolved = resolve(config)
        self.config = config
        self.detokenize = detokenize
        self.platform = self.resolved.platform
        self.model_config = self.resolved.model
        self.max_num_batched_tokens = self.resolved.max_num_batched_tokens
        self.block_size = self.resolved.block_size
        parts = build_engine(self.resolved)
        self.tokenizer = parts.tokenizer
        self.runner, self.draft_runner = parts.runner, parts.draft_runner
        self.kv_cache, self.scheduler = parts.kv_cache, parts.scheduler
        self.model_proposer = parts.model_proposer
        self.verification_bytes = parts.verification_bytes
        self.sync_verification_reason = parts.sync_verification_reason
        self.spec_decode_stats = SpecDecodeStats()
        self._parents: dict[str, ParentRequest] = {}
        self._in_flight: _Launched | None = None  # launched, its tokens not read yet
        self._grammars: GrammarCompiler | None = None  # made for the first structured request
        self.eos_token_ids = self.model_config.eos_token_ids | (
            {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        )

    def shutdown(self) -> None:
        """Stop what runs beside this process: the tensor-parallel workers, if any."""
        self.runner.shutdown()

    # ----------------------------------------------------------------- requests

    def tokenize_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        stream: bool = True,
    ) -> None:
        """Queue a request; raise ``ValueError`` (and queue nothing) if it is invalid.

        With ``stream`` its output is returned by every step that advances it; without, only
        by the step that finishes it (which saves building outputs nobody reads).
        """
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = (params or SamplingParams()).clone()
        params.eos_token_ids = frozenset(self.eos_token_ids)
        text, token_ids = self.tokenize_prompt(prompt)
        self._validate_prompt(token_ids)
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
            )
            children.append(child)
        if params.structured_outputs is not None:
            grammars = self._grammar_compiler().request_grammars(
                params.structured_outputs, params.n
            )
            for child, grammar in zip(children, grammars):
                child.grammar = grammar
        detokenizers = [
            IncrementalDetokenizer(self.tokenizer, token_ids, params)
            for _ in children
            if self.detokenize
        ]
        self._parents[request_id] = ParentRequest(
            request_id, text, token_ids, children, detokenizers, stream
        )
        for child in children:
            self.scheduler.add(child)

    def _grammar_compiler(self) -> GrammarCompiler:
        if self._grammars is None:
            # xgrammar is imported only by an engine that sees a grammar.
            from heron.structured.grammar import GrammarCompiler

            self._grammars = GrammarCompiler(
                self.tokenizer, self.model_config.vocab_size, self.eos_token_ids
            )
        return self._grammars

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
    ) -> RequestOutput | None:
        """Stop a request, or only its sample ``sample_index``, now; the blocks return to the
        pool. Unknown ids are ignored."""
        parent = self._parents.get(request_id)
        if parent is None:
            return None
        for child in parent.children:
            if not child.is_finished and sample_index in (None, child.sample_index):
                child.finish(FinishReason.ABORT)
                self.scheduler.remove(child)
        if all(c.is_finished for c in parent.children):
            del self._parents[request_id]
        return parent.output()

    def samples(self, request_id: str) -> list[Request]:
        """The sequences (one per sample) of an unfinished user request."""
        return self._parents[request_id].children

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._parents)

    # ----------------------------------------------------------------- the step

    def step(self) -> list[RequestOutput]:
        """Run one step; return the outputs of every user request it advanced.

        With asynchronous scheduling (the default) a step whose tokens stay on the device is
        read one call later: this call schedules and launches the next step first, so the host's
        work (scheduling, inputs, detokenisation, stop checks) overlaps the device's. A step
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
        touched: dict[str, ParentRequest] = {}
        if previous is not None and not self._runs_past(previous.launched):
            # Proposals start from the last token: read it before scheduling.
            self._read(previous, touched)
            previous = None
        verifying = previous.launched if previous and previous.launched.rollback else None
        schedule = self.scheduler.schedule(verifying)
        plan = schedule.plan
        launched = None
        if plan.request_ids or plan.finished_ids or plan.preempted_ids:
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
            if step.hidden_states is not None and self.scheduler.proposes:
                # (while the batch is too large to propose, the head is not fed)
                self.model_proposer.take_hidden_states(
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
            for request, n in zip(launched.sample_requests, launched.num_pending):
                request.num_pending_tokens += n
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

        outputs = []
        for parent in touched.values():
            # (the last child first: while a request runs, one look settles it)
            finished = parent.children[-1].is_finished and all(
                c.is_finished for c in parent.children
            )
            if finished:
                del self._parents[parent.request_id]
            if finished or parent.stream:
                outputs.append(parent.output())
        return outputs

    def _runs_past(self, launched: LaunchedStep) -> bool:
        """Whether the next step may be scheduled before ``launched`` is read: while nothing is
        proposed (its pending tokens are fed on the device), or past a verification left on
        the device while every running request samples on the device (none waits for its
        tokens on the host: grammar, penalties, logprobs, ``min_tokens``)."""
        if launched.rollback is None:
            return not self.scheduler.proposes
        return all(r.grammar is None and on_device(r) for r in self.scheduler.running)

    def _token_bitmask(self, sample_requests: list[Request]) -> torch.Tensor:
        """The sampled rows' grammar masks; a request that finished when the previous step was
        read (its token will be dropped) is left free."""
        grammars = [None if r.is_finished else r.grammar for r in sample_requests]
        return self._grammars.token_bitmask(grammars)

    def _read(self, launched: _Launched, touched: dict[str, ParentRequest]) -> None:
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
        for request, token_id, logprob in zip(requests, result.token_ids, result.logprobs):
            if request.status is RequestStatus.FINISHED:
                continue  # stopped or aborted while this step ran: the token is dropped
            self._append(request, token_id, logprob, now, touched)

    def _read_verified(
        self,
        launched: _Launched,
        result: StepOutput,
        touched: dict[str, ParentRequest],
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
        touched: dict[str, ParentRequest],
    ) -> None:
        """One new token of a running request: output, detokenizer, stop checks, grammar."""
        parent = self._parents[request.parent_id]
        request.append_output_token(token_id)
        if logprob is not None:
            request.logprobs.append(logprob)
        if request.first_token_time is None:
            request.first_token_time = now
        detokenizer = parent.detokenizers[request.sample_index] if self.detokenize else None
        stop_string = detokenizer.append(token_id) if detokenizer else None
        stop = check_stop(request, token_id, stop_string, self.model_config.max_model_len)
        if request.grammar is not None and not request.grammar.accept(token_id):
            # a grammar that failed to compile, or a token it refuses (logged by accept)
            stop = (FinishReason.ABORT, None)
        if stop is not None:
            request.finish(*stop)
            if detokenizer:
                detokenizer.finish()
            self.scheduler.remove(request)
        touched[parent.request_id] = parent
