"""Continuous batching with chunked prefill, prefix reuse and preemption by recomputation."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from heron.cache.coordinator import KVCacheCoordinator
from heron.config import SpeculativeConfig
from heron.engine.request import Request, RequestStatus
from heron.execution.sampler import on_device
from heron.execution.step_plan import (
    DeviceDrafts,
    EntryCopies,
    NewRequest,
    SentTables,
    StepPlan,
    VerifiedCopies,
)
from heron.speculative import ModelProposer, NgramProposer

if TYPE_CHECKING:
    from heron.execution.model_runner import LaunchedStep


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    speculative: SpeculativeConfig | None = None
    # While at most this many requests run, pad every decode row's proposals to
    # num_speculative_tokens once any row has some, so verification steps are uniform (what
    # verification graphs replay); 0: never.
    uniform_proposals_up_to: int = 0
    # Whether the target's runner takes a model proposer's proposals on the device (a
    # single-rank one does); otherwise they are read here.
    drafts_on_device: bool = False
    # Fair prefill (vLLM's names): a prefill of more tokens than the threshold is long (0:
    # none is); at most so many prefills (long ones) are in progress at once.
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int | None = None  # None: no limit
    max_long_partial_prefills: int | None = None


class ScheduledRequest(NamedTuple):
    """One request's share of a step (a tuple: built for every running request every step, and
    a named tuple is cheaper to build than a frozen dataclass)."""

    request: Request
    num_new_tokens: int  # proposed tokens included
    samples: bool  # the step reaches the request's last token, so it samples the next one
    num_proposed: int = 0  # tokens after the last one, verified by the step


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    plan: StepPlan = field(default_factory=StepPlan)  # what the runner is told
    drafts: DeviceDrafts | None = None  # the proposals the plan's device_drafts count

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """Decides each step which requests run and how many of their tokens.

    Every step, running requests come first (a decode token each, or their next prefill chunk),
    then waiting requests join while the token budget, the sequence limit and the KV pool allow.
    A request whose blocks cannot be allocated preempts the most recently admitted running
    request: its blocks are freed and it goes back to the front of the queue, to be recomputed
    (its generated tokens are kept, so nothing is lost). A prefill chunk may be cut short where
    a cache group keeps a prefix checkpoint (``KVCacheCoordinator.chunk_end``).

    Prefill is fair: while requests wait, a long prefill's chunk is cut to
    ``long_prefill_token_threshold``, so that short prompts arriving beside it share its step
    instead of waiting for its last chunk; waiting prefills past the partial-prefill limits are
    passed over (long ones first) for those behind them.

    With speculative decoding a decode step also computes the tokens proposed after the last
    one (the plan's ``draft_token_ids``); :meth:`reject` takes back those the step refused.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheCoordinator,
        model_proposer: ModelProposer | None = None,
    ) -> None:
        """``model_proposer``: the proposer of a method that runs a model (built by the engine,
        which owns its runner); n-gram proposals are made here."""
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # For the next plan: requests gone since the last one, and those whose tables were
        # dropped; how much of each table the runner holds.
        self._finished_ids: list[str] = []
        self._preempted_ids: list[str] = []
        self._sent = SentTables()
        spec = config.speculative
        self._proposer: NgramProposer | ModelProposer | None = model_proposer
        if spec is not None and spec.method == "ngram":
            self._proposer = NgramProposer(
                spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
            )
        self._propose_up_to = (spec.disable_by_batch_size if spec else None) or config.max_num_seqs

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self, verifying: LaunchedStep | None = None) -> SchedulerOutput:
        """``verifying``: the verification step still on the device that this pass runs past,
        as if it accepted every proposal (the pending tokens count so); its requests may
        propose again, from its emitted tokens."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens

        running, allocate_slots = self.running, self.kv_cache.allocate_slots
        max_model_len = self.config.max_model_len
        proposals = self._proposals(budget, verifying) if self._proposer is not None else {}
        if isinstance(proposals, DeviceDrafts):  # (their counts; the tokens stay on the device)
            out.drafts, counts = proposals, dict(zip(proposals.request_ids, proposals.counts))
        else:
            counts = {request_id: len(p) for request_id, p in proposals.items()}
        prefills = _Prefills(self.config, contended=bool(self.waiting))
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            if request.pending_tokens_end_it(max_model_len):
                i += 1  # finishes with the token being sampled: nothing left to compute
                continue
            remaining = request.num_tokens - request.num_computed_tokens
            num_new = prefills.chunk(remaining, budget)
            if num_new > 1:
                num_new = self.kv_cache.chunk_end(request, request.num_computed_tokens, num_new)
            num_proposed = min(counts.get(request.request_id, 0), budget - 1) if counts else 0
            while not allocate_slots(request, num_new + num_proposed):
                victim = running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                if num_proposed and out.drafts is None:
                    proposed = proposals[request.request_id][:num_proposed]
                    out.plan.draft_token_ids[request.request_id] = proposed
                elif num_proposed:
                    out.plan.device_drafts[request.request_id] = num_proposed
                out.scheduled.append(
                    ScheduledRequest(
                        request, num_new + num_proposed, num_new == remaining, num_proposed
                    )
                )
                budget -= num_new + num_proposed
                i += 1

        # Admitting new work right after a preemption would only thrash the pool.
        passed: list[Request] = []  # passed over: their grammars or a prefill limit
        while (
            not out.preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            if request.waits_for_grammar:
                passed.append(self.waiting.popleft())
                continue
            computed_blocks, num_cached = self.kv_cache.get_computed_blocks(request)
            remaining = request.num_tokens - num_cached
            if not prefills.may_start(remaining):
                passed.append(self.waiting.popleft())
                continue
            prefills.contended = len(self.waiting) > 1
            num_new = prefills.chunk(remaining, budget)
            if num_new > 1:
                num_new = self.kv_cache.chunk_end(request, num_cached, num_new)
            if not self.kv_cache.allocate_slots(request, num_new, computed_blocks):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
                request.num_cached_tokens = num_cached
                out.plan.new_requests.append(_new_request(request))
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new, num_new == remaining))
            budget -= num_new
        self.waiting.extendleft(reversed(passed))
        self._fill_plan(out)
        return out

    @property
    def proposes(self) -> bool:
        """Whether this pass would make proposals (speculation on, the batch small enough)."""
        return self._proposer is not None and len(self.running) <= self._propose_up_to

    def _proposals(
        self, budget: int, verifying: LaunchedStep | None
    ) -> dict[str, list[int]] | DeviceDrafts:
        """Each running request's proposals (none while more requests run than
        ``disable_by_batch_size``), padded to ``num_speculative_tokens`` with uniform steps;
        a model proposer's stay on the device where the runner takes them so (it proposes
        that many itself for uniform steps; a row its pool cannot hold then makes the step
        non-uniform)."""
        if not self.proposes:
            return {}
        verified = {} if verifying is None else verifying.rows
        proposing, rooms, limits = [], [], []
        k = self._proposer.num_tokens
        uniform = len(self.running) <= self.config.uniform_proposals_up_to
        on_device = self.config.drafts_on_device and isinstance(self._proposer, ModelProposer)
        max_model_len = self.config.max_model_len
        for request in self.running:
            # (a request whose pending tokens may end it is not scheduled: see schedule)
            if request.num_tokens - request.num_computed_tokens == 1 and not (
                request.pending_tokens_end_it(max_model_len)
            ):
                room = self._verification_room(request, budget - 1, verified)
                if room > 0:
                    proposing.append(request)
                    rooms.append(room)
                    if on_device and uniform:
                        limits.append(min(k, room))
                    else:
                        limits.append(min(k, self._proposal_limit(request, room)))
        made = self._propose(proposing, limits, verifying)
        if on_device:
            return made
        # (request, the tokens its step may verify, its proposals)
        rows = list(zip(proposing, rooms, made))
        if uniform and any(proposed for _, _, proposed in rows):
            for request, room, proposed in rows:
                # any token does, as each is verified: the last one (text often repeats); past
                # max_tokens too (the tokens after the one that ends the request are dropped),
                # so that a request's last steps keep the query length of the graphs
                pad = (proposed or request.all_token_ids)[-1]
                proposed += [pad] * (min(k, room) - len(proposed))
        return {request.request_id: proposed for request, _, proposed in rows}

    def _propose(
        self, requests: list[Request], limits: list[int], verifying: LaunchedStep | None
    ) -> list[list[int]] | DeviceDrafts:
        """At most ``limits[i]`` proposals for ``requests[i]``: a model proposer's in one call
        (kept on the device where the runner takes them so)."""
        proposer = self._proposer
        if not isinstance(proposer, ModelProposer):
            return [
                proposer.propose(r.request_id, r.all_token_ids, limit)
                for r, limit in zip(requests, limits)
            ]
        # (a model runs only for rows that may get a proposal)
        wanted = [i for i, limit in enumerate(limits) if limit > 0]
        drafts = proposer.propose(
            [requests[i] for i in wanted], [limits[i] for i in wanted], verifying
        )
        if self.config.drafts_on_device:
            return drafts
        out: list[list[int]] = [[] for _ in requests]
        for i, proposed in zip(wanted, drafts.to_lists()):
            out[i] = proposed
        return out

    def _verification_room(self, request: Request, budget: int, verified: dict[str, int]) -> int:
        """How many tokens after its last one a decode step may compute for the request: none
        for a row the verifier cannot sample (logprobs, penalties, an unmet ``min_tokens``, a
        grammar) or whose last token is still being sampled (except by the verification this
        pass runs past, whose emitted tokens a model proposer takes on the device: requests in
        ``verified``); never past the context or the step's token budget."""
        pending = request.num_pending_tokens and request.request_id not in verified
        if pending or request.grammar is not None or not on_device(request):
            return 0
        return min(budget, self.config.max_model_len - request.num_tokens - 1)

    def _proposal_limit(self, request: Request, room: int) -> int:
        """How many of those tokens may be proposals: none past ``max_tokens`` (counting the
        pending tokens as if all were accepted)."""
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is None:
            return room
        num_output = request.num_output_tokens + request.num_pending_tokens
        return min(room, max_tokens - num_output - 1)

    def reject(self, request: Request, num_rejected: int) -> None:
        """The step computed ``num_rejected`` proposed tokens that were refused: the request's
        computed tokens and its blocks go back to end before them."""
        if not num_rejected:
            return
        request.num_computed_tokens -= num_rejected
        self.kv_cache.truncate(request, request.num_computed_tokens)
        self._sent.shrink(request.request_id, self.kv_cache.block_tables(request.request_id))
        if isinstance(self._proposer, ModelProposer):
            self._proposer.reject(request)

    def _fill_plan(self, out: SchedulerOutput) -> None:
        """The step's rows, and what changed for the runner since the last plan."""
        plan = out.plan
        plan.finished_ids.extend(self._finished_ids)
        plan.preempted_ids.extend(self._preempted_ids)
        self._finished_ids.clear()
        self._preempted_ids.clear()
        scheduled = out.scheduled
        plan.request_ids.extend([item.request.request_id for item in scheduled])
        plan.num_computed.extend([item.request.num_computed_tokens for item in scheduled])
        plan.num_new.extend([item.num_new_tokens for item in scheduled])
        plan.samples.extend([item.samples for item in scheduled])
        # Only a request that allocated this pass can have new table entries.
        changed = self.kv_cache.changed_tables
        for request_id in changed:
            plan.table_updates.extend(
                self._sent.updates(request_id, self.kv_cache.block_tables(request_id))
            )
        changed.clear()
        for g, (before, after, verified) in enumerate(self.kv_cache.take_state_copies()):
            if before:
                plan.copies_before.append(EntryCopies(g, *map(list, zip(*before))))
            if after:
                plan.copies_after.append(EntryCopies(g, *map(list, zip(*after))))
            if verified:
                plan.copies_verified.append(VerifiedCopies(g, *map(list, zip(*verified))))

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request)
        self._sent.forget(request.request_id)
        if self._proposer is not None:
            self._proposer.forget(request.request_id)
        self._preempted_ids.append(request.request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish_step(self, output: SchedulerOutput) -> None:
        """The step ran: its tokens are now in the cache."""
        for item in output.scheduled:
            item.request.num_computed_tokens += item.num_new_tokens

    def remove(self, request: Request) -> None:
        """Drop a finished or aborted request and return its blocks to the pool."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv_cache.free(request)
        self._sent.forget(request.request_id)
        self._finished_ids.append(request.request_id)
        if self._proposer is not None:
            self._proposer.forget(request.request_id)


class _Prefills:
    """One pass's prefills in progress, for the fair-prefill rule."""

    def __init__(self, config: SchedulerConfig, contended: bool) -> None:
        self.threshold = config.long_prefill_token_threshold
        self.max_all = config.max_num_partial_prefills
        self.max_long = config.max_long_partial_prefills
        self.contended = contended  # whether requests wait behind the one being scheduled
        self.num_all = self.num_long = 0

    def _long(self, remaining: int) -> bool:
        return 0 < self.threshold < remaining

    def may_start(self, remaining: int) -> bool:
        """Whether a waiting request with ``remaining`` tokens to compute may start now."""
        if remaining <= 1:
            return True  # a decode after a recomputation
        if self.max_all is not None and self.num_all >= self.max_all:
            return False
        if self.max_long is not None and self._long(remaining):
            return self.num_long < self.max_long
        return True

    def chunk(self, remaining: int, budget: int) -> int:
        """How many of a request's ``remaining`` tokens this step computes (counting it)."""
        if remaining > 1:
            self.num_all += 1
            if self._long(remaining):
                self.num_long += 1
                if self.contended:
                    return min(self.threshold, budget)
        return min(remaining, budget)


def _new_request(request: Request) -> NewRequest:
    params = request.sampling_params
    return NewRequest(
        request.request_id,
        list(request.all_token_ids),
        request.num_prompt_tokens,
        params,
        None if params.seed is None else params.seed + request.sample_index,
    )
