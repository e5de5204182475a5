"""Continuous batching with chunked prefill, prefix reuse and preemption by recomputation."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from heron.cache.coordinator import KVCacheCoordinator
from heron.engine.request import Request, RequestStatus
from heron.execution.step_plan import NewRequest, SentTables, StepPlan


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


class ScheduledRequest(NamedTuple):
    """One request's share of a step (a tuple: built for every running request every step, and
    a named tuple is cheaper to build than a frozen dataclass)."""

    request: Request
    num_new_tokens: int
    samples: bool  # the step reaches the request's last token, so it samples the next one


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    plan: StepPlan = field(default_factory=StepPlan)  # what the runner is told

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """Decides each step which requests run and how many of their tokens.

    Every step, running requests come first (a decode token each, or their next prefill chunk),
    then waiting requests join while the token budget, the sequence limit and the KV pool allow.
    A request whose blocks cannot be allocated preempts the most recently admitted running
    request: its blocks are freed and it goes back to the front of the queue, to be recomputed
    (its generated tokens are kept, so nothing is lost).
    """

    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheCoordinator) -> None:
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

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens

        running, allocate_slots = self.running, self.kv_cache.allocate_slots
        max_model_len = self.config.max_model_len
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            if request.pending_tokens_end_it(max_model_len):
                i += 1  # finishes with the token being sampled: nothing left to compute
                continue
            remaining = request.num_tokens - request.num_computed_tokens
            num_new = min(remaining, budget)
            while not allocate_slots(request, num_new):
                victim = running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.scheduled.append(ScheduledRequest(request, num_new, num_new == remaining))
                budget -= num_new
                i += 1

        # Admitting new work right after a preemption would only thrash the pool.
        compiling: list[Request] = []  # passed over until their grammars are ready
        while (
            not out.preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            if request.waits_for_grammar:
                compiling.append(self.waiting.popleft())
                continue
            computed_blocks, num_cached = self.kv_cache.get_computed_blocks(request)
            remaining = request.num_tokens - num_cached
            num_new = min(remaining, budget)
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
        self.waiting.extendleft(reversed(compiling))
        self._fill_plan(out)
        return out

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

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request)
        self._sent.forget(request.request_id)
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


def _new_request(request: Request) -> NewRequest:
    params = request.sampling_params
    return NewRequest(
        request.request_id,
        list(request.all_token_ids),
        request.num_prompt_tokens,
        params,
        None if params.seed is None else params.seed + request.sample_index,
    )
