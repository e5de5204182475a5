"""Continuous batching with chunked prefill, prefix reuse and preemption by recomputation."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from operator import methodcaller
from typing import TYPE_CHECKING, NamedTuple, TypeVar

from heron.cache.coordinator import KVCacheCoordinator
from heron.engine.request import FinishReason, Request, RequestStatus
from heron.execution.step_plan import (
    DeviceDrafts,
    EntryCopies,
    NewRequest,
    SentTables,
    StepPlan,
    VerifiedCopies,
)
from heron.kv_transfer.base import TransferResults

if TYPE_CHECKING:
    from heron.cache.manager import StateCopies
    from heron.kv_transfer.base import KVConnectorMeta, KVConnectorScheduler
    from heron.speculative import Proposer

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    # Fair prefill (vLLM's names): a prefill of more tokens than the threshold is long (0:
    # none is); at most so many prefills (long ones) are in progress at once.
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int | None = None  # None: no limit
    max_long_partial_prefills: int | None = None
    max_loras: int = 0  # LoRA adapters the running requests may use at once
    # A chunk never ends inside an image (the model's image tokens attend to their whole image)
    whole_images: bool = False


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
    # requests the connector fails (with why), out of the queue: the caller aborts them
    failed: list[tuple[Request, str]] = field(default_factory=list)

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
    one (the plan's ``draft_token_ids``, or ``device_drafts``), which the engine asked its
    proposer for before the pass; :meth:`reject` takes back those the step refused.

    With a KV connector, a waiting request whose prefix an outside store holds past the
    device pool's hit is given blocks for it and waits in ``loading`` while the step loads
    them (other requests run); once the load ended (:meth:`transfers_finished`) it runs from
    there, and if it failed or outlasted the connector's timeout it goes back to the queue to
    compute those tokens. A connector that raises is switched off (:meth:`stop_transfers`):
    the engine runs on without it.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheCoordinator,
        proposer: Proposer | None = None,
        connector: KVConnectorScheduler | None = None,
    ) -> None:
        """``proposer``: told of refused proposals and of requests it may forget (preempted,
        finished, aborted); ``connector``: a KV connector's scheduler side."""
        self.config = config
        self.kv_cache = kv_cache
        self.connector = connector
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Requests whose blocks a connector loads.
        self.loading: dict[str, _Loading] = {}
        # Finished requests whose blocks a connector keeps for another instance to read.
        self.held: dict[str, Request] = {}
        # Requests aborted while loading: their blocks are freed once the load ends (a read
        # in flight may still write them).
        self.draining: dict[str, Request] = {}
        self.num_preemptions = 0
        # For the next plan: requests gone since the last one, and those whose tables were
        # dropped; how much of each table the runner holds.
        self._finished_ids: list[str] = []
        self._preempted_ids: list[str] = []
        self._sent = SentTables()
        self._proposer = proposer

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(
        self, proposals: dict[str, list[int]] | DeviceDrafts | None = None
    ) -> SchedulerOutput:
        """``proposals``: running requests' proposals to verify (``Speculator.propose``'s), by
        request on the host or left on the device; a request's step computes as many of them
        as its budget and blocks allow."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        if self.held:
            self.release_held()
        if self.loading:
            expired = self._guarded(methodcaller("timed_out"), [])
            if expired:
                logger.warning("KV connector: loads of %s timed out (recomputed)", expired)
                self.transfers_finished(TransferResults(failed_loads=expired))

        running, allocate_slots = self.running, self.kv_cache.allocate_slots
        max_model_len = self.config.max_model_len
        proposals = {} if proposals is None else proposals
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
            num_new = remaining  # (a decoding request's one token, or none: no call)
            if remaining > 1:
                num_new = prefills.chunk(remaining, budget)
                if num_new > 1:
                    num_new = self.kv_cache.chunk_end(request, request.num_computed_tokens, num_new)
                num_new = self._whole_images(request, request.num_computed_tokens, num_new, budget)
                if not num_new:
                    i += 1  # its next image does not fit this step's budget
                    continue
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
        passed: list[Request] = []  # passed over: their grammars, a prefill limit, adapters
        adapters = self._running_adapters()
        while (
            not out.preempted
            and self.waiting
            and budget > 0
            and len(self.running) + len(self.loading) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            lora = request.lora_request
            if request.waits_for_grammar or (
                lora is not None
                and lora.lora_int_id not in adapters
                and len(adapters) >= self.config.max_loras
            ):
                passed.append(self.waiting.popleft())
                continue
            computed_blocks, num_cached = self.kv_cache.get_computed_blocks(request)
            if self.connector is not None:
                external = self._guarded(methodcaller("lookup", request, num_cached))
                if external is None:
                    continue  # (the connector failed: look up again without it)
                if external.wait:
                    passed.append(self.waiting.popleft())
                    continue
                if external.error is not None:
                    out.failed.append((self.waiting.popleft(), external.error))
                    continue
                if external.num_tokens:
                    if not self._load(request, computed_blocks, num_cached, external.num_tokens):
                        break
                    if request.request_id in self.loading:  # (else the connector failed)
                        out.plan.new_requests.extend(self._first_scheduled(request, num_cached))
                    continue
            remaining = request.num_tokens - num_cached
            if not prefills.may_start(remaining):
                passed.append(self.waiting.popleft())
                continue
            prefills.contended = len(self.waiting) > 1
            num_new = prefills.chunk(remaining, budget)
            if num_new > 1:
                num_new = self.kv_cache.chunk_end(request, num_cached, num_new)
            num_new = self._whole_images(request, num_cached, num_new, budget)
            if not num_new:
                break  # its first image does not fit this step's budget
            if not self.kv_cache.allocate_slots(request, num_new, computed_blocks):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            out.plan.new_requests.extend(self._first_scheduled(request, num_cached))
            self.running.append(request)
            if lora is not None:
                adapters.add(lora.lora_int_id)
            out.scheduled.append(ScheduledRequest(request, num_new, num_new == remaining))
            budget -= num_new
        self.waiting.extendleft(reversed(passed))
        self._fill_plan(out)
        return out

    def _whole_images(self, request: Request, start: int, num_new: int, budget: int) -> int:
        """``num_new`` tokens from ``start``, cut back to before an image the chunk would
        end inside (or stretched to its end, where that is all the chunk would hold and the
        budget allows), when the model's image tokens attend to their whole image."""
        if not self.config.whole_images:
            return num_new
        end = start + num_new
        for item in request.images:
            if item.offset < end < item.end:
                if item.offset > start:
                    return item.offset - start
                return item.end - start if item.end - start <= budget else 0
        return num_new

    def _running_adapters(self) -> set[int]:
        """The LoRA adapters of the running requests: a request of another joins them only
        while fewer than ``max_loras`` are in use (every step's fit the device slots)."""
        if not self.config.max_loras:
            return set()
        return {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}

    def _first_scheduled(self, request: Request, num_cached: int) -> list[NewRequest]:
        """The runner's news of a request scheduled for the first time (none if it was
        before: preempted, it keeps its runner state)."""
        if request.first_scheduled_time is not None:
            return []
        request.first_scheduled_time = time.monotonic()
        request.num_cached_tokens = num_cached
        return [_new_request(request)]

    def _load(
        self,
        request: Request,
        computed_blocks: tuple[list[int], ...],
        num_cached: int,
        num_external: int,
    ) -> bool:
        """Give ``request`` blocks for ``num_external`` tokens past its ``num_cached`` on the
        device and have the connector load them; False (nothing changed) if they do not fit."""
        if not self.kv_cache.allocate_slots(request, num_external, computed_blocks):
            return False
        self.waiting.popleft()
        self.kv_cache.loads(request.request_id)
        request.num_computed_tokens = num_cached
        first = request.first_scheduled_time is None
        self.loading[request.request_id] = _Loading(request, num_external, first)
        tables = self.kv_cache.block_tables(request.request_id)
        self._guarded(methodcaller("load", request, tables, num_cached, num_external))
        return True

    def transfers_finished(self, results: TransferResults) -> list[tuple[Request, str]]:
        """The connector's worker side ended these transfers: a loaded request runs from past
        its loaded tokens; one whose load failed is queued again to compute them, unless the
        connector fails it: those are returned, with why, for the caller to abort now."""
        self._guarded(methodcaller("finished", results))
        for request_id in (*results.failed_loads, *results.loaded):
            draining = self.draining.pop(request_id, None)
            if draining is not None:
                self._free(draining)
        failed = []
        for request_id in results.failed_loads:  # (first: a failure outweighs a success)
            loading = self.loading.pop(request_id, None)
            if loading is None:  # (aborted while loading)
                continue
            error = self._guarded(methodcaller("failed_load_error", request_id))
            if error is not None:
                failed.append((loading.request, error))  # (its blocks go as it is removed)
            else:
                # Freed at its device hit: the loaded blocks' prefix entries are dropped.
                self._requeue(loading.request)
        for request_id in results.loaded:
            loading = self.loading.pop(request_id, None)
            if loading is not None:
                request = loading.request
                request.num_computed_tokens += loading.num_tokens
                if loading.first:
                    request.num_cached_tokens += loading.num_tokens
                request.status = RequestStatus.RUNNING
                self.running.append(request)
        return failed

    def reject(self, request: Request, num_rejected: int) -> None:
        """The step computed ``num_rejected`` proposed tokens that were refused: the request's
        computed tokens and its blocks go back to end before them."""
        if not num_rejected:
            return
        request.num_computed_tokens -= num_rejected
        self.kv_cache.truncate(request, request.num_computed_tokens)
        self._sent.shrink(request.request_id, self.kv_cache.block_tables(request.request_id))
        if self._proposer is not None:
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
        state_copies = self.kv_cache.take_state_copies()
        if self.connector is not None:
            meta = self._guarded(lambda c: self._step_transfers(c, scheduled, state_copies))
            plan = out.plan = replace(plan, kv_connector=meta)
        for g, (before, after, verified, *_) in enumerate(state_copies):
            if before:
                plan.copies_before.append(EntryCopies(g, *map(list, zip(*before))))
            if after:
                plan.copies_after.append(EntryCopies(g, *map(list, zip(*after))))
            if verified:
                plan.copies_verified.append(VerifiedCopies(g, *map(list, zip(*verified))))

    def _step_transfers(
        self,
        connector: KVConnectorScheduler,
        scheduled: list[ScheduledRequest],
        state_copies: list[StateCopies],
    ) -> KVConnectorMeta | None:
        """Tell the connector each scheduled request's tables and hashes and the pass's new
        state checkpoints; the step's transfers."""
        for item in scheduled:
            request_id = item.request.request_id
            connector.scheduled(
                item.request,
                self.kv_cache.block_tables(request_id),
                self.kv_cache.block_hashes(request_id),
                item.num_new_tokens,
            )
        for g, copies in enumerate(state_copies):
            if copies.registered or copies.confirmed:
                connector.checkpointed(g, copies)
        return connector.take_step_meta()

    def _guarded(
        self, call: Callable[[KVConnectorScheduler], T], default: T | None = None
    ) -> T | None:
        """``call(connector)``, or ``default`` once a connector that raised was switched off:
        a connector's failure never stops the engine."""
        if self.connector is None:
            return default
        try:
            return call(self.connector)
        except Exception:
            logger.exception("KV connector failed: the engine runs on without it")
            self.stop_transfers()
            return default

    def stop_transfers(self) -> None:
        """Stop using the KV connector (it failed, or the engine shuts down): its loading
        requests go back to the queue to compute their tokens, and the blocks it held for
        another instance or for a read in flight (aborted requests') are freed."""
        self.connector = None
        for loading in list(self.loading.values()):
            self._requeue(loading.request)
        self.loading.clear()
        for request in (*self.held.values(), *self.draining.values()):
            self.kv_cache.free(request)
        self.held.clear()
        self.draining.clear()

    def _preempt(self, request: Request) -> None:
        self._requeue(request)
        request.num_preemptions += 1
        self.num_preemptions += 1

    def _requeue(self, request: Request) -> None:
        """Free the request's blocks and put it back at the head of the queue, to compute
        everything it has no cache for again."""
        self._free(request)
        self._preempted_ids.append(request.request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        self.waiting.appendleft(request)

    def _forget(self, request_id: str) -> None:
        """Tell those who keep something per request that it holds no blocks any more."""
        self._sent.forget(request_id)
        if self._proposer is not None:
            self._proposer.forget(request_id)
        if self.connector is not None:
            self._guarded(methodcaller("forget", request_id))

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
        elif (
            self.loading.pop(request.request_id, None) is not None
            and self.connector.loads_outlive_steps
        ):
            self.draining[request.request_id] = request
            self._finished_ids.append(request.request_id)
            return
        held = self.connector is not None and self._guarded(
            methodcaller(
                "hold",
                request,
                self.kv_cache.transfer_tables(request.request_id),
                request.finish_reason is FinishReason.ABORT,
            ),
            False,
        )
        if held:
            self._forget(request.request_id)
            self.held[request.request_id] = request
        else:
            self._free(request)
        self._finished_ids.append(request.request_id)

    def _free(self, request: Request) -> None:
        """Return the request's blocks to the pool; a connector sees them go (with the hashes
        ``free`` completes: the last full blocks of a finished request's known tokens)."""
        request_id, connector = request.request_id, self.connector
        if connector is not None:
            tables = [list(table) for table in self.kv_cache.block_tables(request_id)]
            hashes = self.kv_cache.block_hashes(request_id)  # (live: free completes it)
        self.kv_cache.free(request)
        if connector is not None:
            self._guarded(methodcaller("freed", request, tables, hashes))
        self._forget(request_id)

    def release_held(self) -> None:
        """Free the held requests' blocks the connector is done with (see also
        :meth:`transfers_finished`, which frees the draining ones')."""
        for request_id in self._guarded(methodcaller("released"), []):
            request = self.held.pop(request_id, None)
            if request is not None:
                self.kv_cache.free(request)


class _Loading(NamedTuple):
    """A request whose blocks a connector loads: ``num_tokens`` of them, at its first
    scheduling or not (only then do they count as cached)."""

    request: Request
    num_tokens: int
    first: bool


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
        request.lora_request,
        request.images,
    )
