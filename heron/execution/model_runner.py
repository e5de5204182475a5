"""ModelRunner: one step of the model, from a step plan to sampled tokens."""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Sequence
from itertools import accumulate

import numpy as np
import torch

from heron.cache.layout import CacheLayout
from heron.cache.paged_parts import PagedParts
from heron.cache.recurrent import RecurrentStateSpec
from heron.cache.spec import CacheSpec
from heron.config import ModelConfig
from heron.execution.cuda_graph import CudaGraphRunner
from heron.execution.next_decode import (
    DecodeChain,
    NextDecode,
    can_chain_decode_steps,
    is_plain_decode,
)
from heron.execution.request_state import RequestState
from heron.execution.sampler import Sampler, on_device, prompt_logprobs, to_device
from heron.execution.step_inputs import BlockTableRows, PreparedStep, StepInputBuilder
from heron.execution.step_plan import DeviceDrafts, Rollback, StepOutput, StepPlan
from heron.metadata import (
    GraphSupport,
    MetadataOperator,
    SequenceMetadata,
    StepBatch,
    StepMetadataError,
)
from heron.models.build import BuiltModel, build_model
from heron.outputs import Logprob
from heron.parallel import SINGLE, TensorParallel
from heron.platforms import Platform
from heron.speculative.verification import (
    DraftRows,
    accept_greedy,
    accepted_block,
    verify,
    verify_on_device,
)

logger = logging.getLogger(__name__)


class LaunchedStep:
    """A step whose device work is queued; :meth:`result` reads what it sampled.

    A step whose sampled rows all sample on the device (greedy or random, without logprobs,
    penalties or a pending ``min_tokens``: :func:`~heron.execution.sampler.on_device`) keeps
    its tokens on the device (``token_ids``) and copies them to pinned host memory without
    waiting, so the host can schedule and prepare the next step while this one runs; the next
    step takes its pending input tokens straight from ``token_ids``. Any other step is read on
    the spot (``is_ready``).

    A verification step left on the device (``ModelRunner.async_verification``) also keeps
    each row's emitted tokens (``emitted``: its accepted proposals and the token after them,
    ``token_ids`` being that last one) and its refused count (``rollback``), for the next
    step to be corrected by on the device and a draft to ingest.
    """

    def __init__(
        self,
        sample_states: list[RequestState],
        token_ids: torch.Tensor | None = None,
        result: StepOutput | None = None,
        hidden_states: torch.Tensor | None = None,
        emitted: DeviceDrafts | None = None,
        rollback: Rollback | None = None,
    ) -> None:
        self.sample_states = sample_states
        self.token_ids = token_ids
        self.emitted, self.rollback = emitted, rollback
        self._result = result
        # The model's last hidden states of every token the step computed, in the plan's row
        # order, where the runner keeps them (an MTP head reads them; the next step may
        # overwrite them).
        self.hidden_states = hidden_states
        self._copied: torch.cuda.Event | None = None
        # What the decode step after this one needs, where the runner chains them.
        self.next_decode: NextDecode | None = None
        if token_ids is not None:
            read = token_ids
            if emitted is not None:  # (each row's emitted tokens, then its refused count)
                rejected = rollback.num_rejected.to(torch.int64)
                read = torch.cat([emitted.tokens.flatten(), rejected])
            self._host_ids = read.to("cpu", non_blocking=True)  # pinned when on CUDA
            if read.is_cuda:
                self._copied = torch.cuda.Event()
                self._copied.record()
        self._read = False

    @property
    def is_ready(self) -> bool:
        return self._result is not None

    @property
    def rows(self) -> dict[str, int]:
        """Each sampled request's row in ``token_ids``."""
        return {s.request_id: i for i, s in enumerate(self.sample_states)}

    def result(self) -> StepOutput:
        """The sampled tokens (waits for the device if they are still on their way).

        The first call appends them to their requests' states: steps are read in launch order,
        so a request's tokens arrive in order even when a step read at once follows one still
        in flight.
        """
        if self._result is None:
            if self._copied is not None:
                self._copied.synchronize()
            ids = self._host_ids.tolist()
            request_ids = [s.request_id for s in self.sample_states]
            if self.emitted is None:
                self._result = StepOutput(request_ids, ids, [None] * len(ids))
            else:
                self._result = self._verified_output(request_ids, ids)
        if not self._read:
            self._read = True
            if self._result.num_accepted:
                for state, tokens in zip(self.sample_states, self._result.row_token_ids()):
                    state.all_token_ids += tokens
            else:
                for state, token_id in zip(self.sample_states, self._result.token_ids):
                    state.all_token_ids.append(token_id)
        return self._result

    def _verified_output(self, request_ids: list[str], ids: list[int]) -> StepOutput:
        """The output of a verification left on the device, from its one download (each row's
        emitted tokens, then each row's refused count)."""
        counts, width = self.emitted.counts, self.emitted.tokens.shape[1]
        rejected = ids[len(counts) * width :]
        accepted = [n - 1 - r for n, r in zip(counts, rejected)]
        tokens = [t for i, a in enumerate(accepted) for t in ids[i * width : i * width + 1 + a]]
        return StepOutput(request_ids, tokens, [None] * len(counts), {}, accepted)


class ModelRunner:
    """Owns the model, its metadata plan, its KV caches and its CUDA graphs; runs one step."""

    def __init__(
        self,
        model_config: ModelConfig,
        platform: Platform,
        block_size: int,
        attention_backend: str,
        seed: int,
        tp: TensorParallel = SINGLE,
        build: Callable[..., BuiltModel] = build_model,
    ) -> None:
        """Under ``tp`` the runner holds this rank's shard of the model and of the caches.
        ``build`` makes the model and its plan (``build_model``'s arguments; an MTP head's is
        another)."""
        self.model_config = model_config
        self.platform = platform
        self.device = platform.device
        self.block_size = block_size
        self.model, self.plan = build(model_config, platform, attention_backend, block_size, tp)
        self.cache = CacheLayout(
            [
                m
                for m in self.model.modules()
                if isinstance(m, MetadataOperator) and m.cache_spec is not None
            ]
        )
        self._bind_cache_groups()
        # Operators whose state a refused proposal cannot be cut out of, with their cache
        # groups: they keep each verified token's state (``verified_state_copies``).
        self._recurrent_owners = [
            (o, g)
            for o, g in zip(self.cache.owners, self.cache.owner_groups)
            if isinstance(o.cache_spec, RecurrentStateSpec)
        ]
        self.sampler = Sampler()
        self.generator = torch.Generator(self.device).manual_seed(seed)
        self.num_blocks: list[int] = []
        self.inputs = StepInputBuilder(block_size, self.device, self.cache_specs)
        self.graphs: CudaGraphRunner | None = None
        self.requests: dict[str, RequestState] = {}
        self._coverage_checked = False
        # Whether each LaunchedStep carries the step's hidden states (for an MTP head).
        self.keep_hidden_states = False
        # Whether a verification step whose rows all sample on the device is left there (read
        # later; the engine sets it where every operator reads lengths only on the device).
        self.async_verification = False
        # Whether decode steps keep what the next decode step of their rows needs to be
        # prepared on the device from them (chain_decode_steps).
        self.chains_decode_steps = False
        self._chain_length = 1
        self._chained: tuple[DecodeChain, int] | None = None  # this launch's step of a chain
        self._launches = 0
        self._counting = torch.zeros(0, dtype=torch.int32)  # 0, 1, 2, ... on the device

    @property
    def cache_specs(self) -> list[CacheSpec]:
        """One spec per cache group; the index is the group's."""
        return self.cache.specs

    @property
    def num_cache_groups(self) -> int:
        return self.cache.num_groups

    def _bind_cache_groups(self) -> None:
        """Tell each metadata group's builder which cache group's tables its operators read."""
        group_of = {}
        for owner, g in zip(self.cache.owners, self.cache.owner_groups):
            if owner.group is None:
                continue
            if group_of.setdefault(id(owner.group), g) != g:
                raise StepMetadataError(
                    f"metadata group {owner.group.group_id} ({owner.group.builder.describe()}) "
                    f"serves operators of different cache specs (layer {owner.layer_name!r})"
                )
        for group in self.plan.groups:
            group.builder.cache_group = group_of.get(id(group), 0)

    def allocate_kv_cache(self, num_blocks: list[int]) -> None:
        """Every cache owner's tensor, sized to its cache group's pool."""
        self.num_blocks = list(num_blocks)
        self.cache.allocate(num_blocks, self.device)

    def reserve_verification(self, max_rows: int, num_proposals: int) -> int:
        """Reserve what verification steps of up to ``max_rows`` verifying rows of
        ``num_proposals`` proposals keep beside the caches (each recurrent layer's states after
        every verified token); returns the bytes, which the KV budget must leave out. Call it
        before sizing the KV cache: on CUDA the profiled peak then includes them."""
        return sum(
            owner.reserve_verification(max_rows, num_proposals, self.device)
            for owner, _ in self._recurrent_owners
        )

    def kv_cache_budget(self, utilization: float, num_tokens: int) -> int:
        """Bytes this device's KV cache may take (``Platform.kv_cache_budget``), after a
        profiled forward over ``num_tokens`` prompt tokens."""
        return self.platform.kv_cache_budget(utilization, self.profile_peak_memory(num_tokens))

    def shutdown(self) -> None:
        """Nothing runs beside this process's own runner (a tensor-parallel one stops its
        workers here)."""

    @torch.inference_mode()
    def profile_peak_memory(self, num_tokens: int) -> int:
        """Peak bytes allocated by a forward over ``num_tokens`` prompt tokens (weights included).

        Runs before the KV cache exists: every operator gets a one-block cache, and the dummy
        prompt's block table points every block at that (null) block.
        """
        # An engine dropped without a collection (engines hold reference cycles) still holds
        # its caches, which the peak would count as this runner's.
        gc.collect()
        torch.cuda.empty_cache()
        self.cache.allocate([1] * self.num_cache_groups, self.device)
        width = -(-num_tokens // self.block_size)
        layouts = [parts.layout_of(1, num_tokens, width) for parts in self.inputs.parts]
        step = StepBatch(1, num_tokens, 1, self.block_size, layouts)
        step.query_lens[0] = step.kv_lens[0] = num_tokens
        step.positions[:] = range(num_tokens)
        step.logits_indices[0] = num_tokens - 1
        step.finish()
        seq = SequenceMetadata.from_step_batch(step, self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.plan.build_views(seq)
        self.model.compute_logits(self.model(seq.token_ids)[seq.logits_indices.long()])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        self.cache.release()
        torch.cuda.empty_cache()
        return peak

    def capture_graphs(
        self, max_batch: int, verify_query_len: int = 1, verify_max_batch: int = 0
    ) -> None:
        """Capture decode graphs, and verification graphs of ``verify_query_len`` tokens per
        row up to ``verify_max_batch`` rows where every group supports uniform steps; or
        explain (once) why steps stay eager."""
        support = self.plan.graph_support
        weakest = min(self.plan.groups, key=lambda g: g.builder.graph_support)
        if support < GraphSupport.DECODE_ONLY:
            logger.warning(
                "CUDA graphs off: metadata group %d (%s) declares graph support %s",
                weakest.group_id,
                weakest.builder.describe(),
                weakest.builder.graph_support.name,
            )
            return
        verify_batches = {}
        if verify_query_len > 1 and support >= GraphSupport.UNIFORM:
            verify_batches[verify_query_len] = verify_max_batch
        elif verify_query_len > 1:
            logger.warning(
                "verification steps run eagerly: metadata group %d (%s) declares graph support %s",
                weakest.group_id,
                weakest.builder.describe(),
                weakest.builder.graph_support.name,
            )
        self.graphs = CudaGraphRunner(self.model, self.plan, self.device, max_batch, verify_batches)
        self.graphs.capture(self.block_size, self.inputs.parts)

    def chain_decode_steps(self, length: int) -> None:
        """From now on, where every cache allows it (:func:`can_chain_decode_steps`), a decode
        step launched right after one of the same rows (a proposer's pass) is prepared on the
        device from it, in chains of ``length`` steps computed at once."""
        self.chains_decode_steps = can_chain_decode_steps(self.cache_specs)
        self._chain_length = length

    @property
    def verify_graph_max_batch(self) -> int:
        """The largest verification step (in rows) that replays a graph; 0 without such
        graphs."""
        if self.graphs is None or self.graphs.query_lens[-1] == 1:
            return 0
        return self.graphs.buckets_of[self.graphs.query_lens[-1]][-1]

    def _apply(self, plan: StepPlan) -> None:
        apply_plan(plan, self.requests, self.inputs.tables, self.device)

    @torch.inference_mode()
    def launch(
        self,
        plan: StepPlan,
        previous: LaunchedStep | None = None,
        drafts: DeviceDrafts | None = None,
        rollback: Rollback | None = None,
    ) -> LaunchedStep:
        """Queue the step's forward pass and sampling; ``previous`` is the step still in flight
        whose sampled tokens are this step's pending inputs, ``drafts`` the proposals on the
        device that the plan's ``device_drafts`` verify (or its ``device_inputs`` ingest).

        ``rollback`` (by default ``previous``'s, a verification left on the device) holds the
        refusals of a verification that this step was scheduled past as if it accepted every
        proposal: each row of its requests is moved back by its refused count on the device
        (positions, slots, KV lengths) before the forward pass; a ``device_inputs`` row takes
        instead its token after the accepted ones."""
        if not self._coverage_checked:
            # Operators added after the build (or outside its scope) must fail loudly, not run
            # on stale metadata.
            self.plan.check_coverage(self.model)
            self._coverage_checked = True
        self._launches += 1
        rejected = None
        step = self._next_decode_step(plan, previous, drafts, rollback)
        if step is None:
            self._apply(plan)
            if not plan.request_ids:
                return LaunchedStep([], result=StepOutput([], [], []))
            step = self.inputs.prepare(plan, self.requests, previous.rows if previous else None)
            seq = step.seq
            if step.pending_sources:
                self._fill_pending_tokens(seq.token_ids, step.pending_sources, previous.token_ids)
            if step.draft_sources:
                self._fill_draft_tokens(seq.token_ids, step.draft_sources, drafts)
            if rollback is None and previous is not None:
                rollback = previous.rollback
            if rollback is not None:
                rejected = _rejected_per_row(plan.request_ids, rollback)
            if rejected is not None and not plan.device_inputs:
                self._move_back(plan, seq, rejected)
        seq = step.seq
        for copies in plan.copies_before:
            self.cache.copy_entries(copies.group, copies.sources, copies.destinations)
        greedy_ids = None  # each row's greedy token, where the step drew them already
        # A graph computes every token's logits: it serves steps that sample every token
        # (not a prefill chunk that samples nothing, nor prompt logprobs' rows first).
        every_token_sampled = step.sample_rows == slice(0, seq.num_tokens)
        if self.graphs is not None and every_token_sampled and self.graphs.can_run(seq):
            hidden, logits, greedy_ids = self.graphs.run(seq)
        else:
            if self.graphs is not None:
                logger.debug("eager step: %d requests, %d tokens", seq.num_reqs, seq.num_tokens)
            self.plan.build_views(seq)
            hidden = self.model(seq.token_ids)
            logits = self.model.compute_logits(hidden[seq.logits_indices.long()])
        for copies in plan.copies_after:
            self.cache.copy_entries(copies.group, copies.sources, copies.destinations)
        kept = hidden if self.keep_hidden_states else None
        states, bitmask = step.sample_states, plan.token_bitmask
        if plan.device_inputs:
            return self._ingested(plan, step, logits, greedy_ids, rejected, kept)
        if plan.verifies:
            if (
                self.async_verification
                and not plan.draft_token_ids
                and not step.prompt_rows
                and bitmask is None
                and all(map(on_device, states))
            ):
                return self._verified_on_device(plan, step, logits, greedy_ids, drafts)
            output = self._verified(plan, step, logits, greedy_ids, drafts)
            self._keep_accepted_states(plan, step.sample_states, output)
            return LaunchedStep(step.sample_states, result=output, hidden_states=kept)
        if states and not step.prompt_rows and all(map(on_device, states)):
            if greedy_ids is not None and all(s.sampling_params.plain_argmax for s in states):
                token_ids = greedy_ids[step.sample_rows]
            else:
                token_ids = self.sampler.sample_on_device(
                    logits[step.sample_rows], states, self.generator, bitmask
                )
            launched = LaunchedStep(states, token_ids=token_ids, hidden_states=kept)
            if seq.is_decode and len(states) == seq.num_reqs:
                self._chain(launched, plan, seq)
            return launched
        token_ids, logprobs = [], []
        if states:
            sampled = self.sampler(logits[step.sample_rows], states, self.generator, bitmask)
            token_ids, logprobs = sampled.token_ids, sampled.logprobs
        request_ids = [s.request_id for s in states]
        output = StepOutput(request_ids, token_ids, logprobs, _prompt_logprobs(step, logits))
        return LaunchedStep(states, result=output, hidden_states=kept)

    def _move_back(self, plan: StepPlan, seq: SequenceMetadata, rejected: torch.Tensor) -> None:
        """Row ``i``'s positions and KV length go back by ``rejected[i]``, and its tokens'
        slots follow their positions (every cache group a full-attention one: each row's table
        starts at its first block; the engine runs ahead only then)."""
        rows = torch.arange(seq.num_reqs, device=self.device)
        repeats = to_device(plan.num_new, self.device)
        token_rows = torch.repeat_interleave(rows, repeats, output_size=seq.num_tokens)
        positions = seq.positions
        positions.sub_(rejected[token_rows])
        seq.kv_lens.sub_(rejected)
        bs = seq.block_size
        blocks, offsets = (positions // bs).long(), positions % bs
        for parts in seq.group_parts:
            if not isinstance(parts, PagedParts):
                raise StepMetadataError(
                    f"a step run ahead of a verification has {type(parts).__name__}, whose "
                    "rows cannot be moved back on the device"
                )
            parts.slot_mapping.copy_(parts.block_tables[token_rows, blocks] * bs + offsets)

    def _ingested(
        self,
        plan: StepPlan,
        step: PreparedStep,
        logits: torch.Tensor,
        greedy_ids: torch.Tensor | None,
        rejected: torch.Tensor | None,
        hidden_states: torch.Tensor | None,
    ) -> LaunchedStep:
        """A draft's step over verified blocks (``device_inputs`` rows only, greedy): each row's
        token is its greedy one after its last accepted token (its last, less its refusals)."""
        if len(plan.device_inputs) != len(plan.request_ids):
            raise ValueError("a step that ingests verified blocks takes no other rows")
        rows = step.sample_rows
        argmax = logits[rows].argmax(dim=-1) if greedy_ids is None else greedy_ids[rows]
        q = plan.num_new[0]
        if all(n == q for n in plan.num_new):  # (uniform: no upload)
            last = torch.arange(q - 1, q * len(plan.num_new), q, device=self.device)
        else:
            last = to_device([end - 1 for end in accumulate(plan.num_new)], self.device)
        index = last if rejected is None else last - rejected
        launched = LaunchedStep(
            step.sample_states, token_ids=argmax[index], hidden_states=hidden_states
        )
        self._chain(launched, plan, step.seq, rejected)
        return launched

    def _chain(
        self,
        launched: LaunchedStep,
        plan: StepPlan,
        seq: SequenceMetadata,
        rejected: torch.Tensor | None = None,
    ) -> None:
        """Where this runner chains decode steps, ``launched`` (a row's token sampled after
        its last, or after its last but ``rejected[i]``) keeps what the decode step after it
        needs."""
        if not self.chains_decode_steps:
            return
        if self._chained is not None:  # a step of a chain: the next one follows in it
            chain, j = self._chained
            launched.next_decode = NextDecode(
                plan.request_ids, chain.group_parts, chain.kv_lens[j], self._launches, chain, j + 1
            )
            return
        positions = seq.kv_lens if rejected is None else seq.kv_lens - rejected
        launched.next_decode = NextDecode(
            plan.request_ids, seq.group_parts, positions, self._launches
        )

    def _next_decode_step(
        self,
        plan: StepPlan,
        previous: LaunchedStep | None,
        drafts: DeviceDrafts | None,
        rollback: Rollback | None,
    ) -> PreparedStep | None:
        """``plan``'s step prepared on the device from ``previous``'s (:mod:`next_decode`),
        where it is the next decode step of the same rows, launched right after it, whose
        tables hold every row's next token; None otherwise. The first such step after a step
        prepared on the host starts a chain of ``chain_decode_steps``' steps."""
        self._chained = None
        after = getattr(previous, "next_decode", None)
        if (
            after is None
            or after.launch != self._launches - 1
            or drafts is not None
            or rollback is not None
            or plan.request_ids != after.request_ids
            or not is_plain_decode(plan)
        ):
            return None
        kv_lens = np.array(plan.num_computed, dtype=np.int32) + 1
        tables = self.inputs.tables
        rows = tables.rows(plan.request_ids)
        if not tables.covers(rows, -(-kv_lens // self.block_size)):
            return None
        n = len(kv_lens)
        chain, j = after.chain, after.index
        if chain is None or j == chain.num_steps:
            if self._counting.shape[0] <= max(n, self._chain_length):
                size = 2 * max(n, self._chain_length) + 1
                self._counting = torch.arange(size, dtype=torch.int32, device=self.device)
            chain = DecodeChain.start(
                after.group_parts,
                after.positions,
                self._chain_length,
                self.block_size,
                self._counting,
            )
            j = 0
        self._chained = chain, j
        tables.wrote(rows, kv_lens)
        seq = chain.step(j, previous.token_ids, kv_lens)
        return PreparedStep(seq, previous.sample_states, slice(0, n), [], [], [])

    def _verified_on_device(
        self,
        plan: StepPlan,
        step: PreparedStep,
        logits: torch.Tensor,
        greedy_ids: torch.Tensor | None,
        drafts: DeviceDrafts,
    ) -> LaunchedStep:
        """:meth:`_verified` with nothing read: each row's emitted tokens and refused count
        stay on the device (``LaunchedStep.emitted``, ``rollback``), the same draws as there."""
        states = step.sample_states
        counts = [plan.num_proposed(s.request_id) for s in states]
        rows = logits[step.sample_rows]
        if all(s.sampling_params.plain_argmax for s in states):
            argmax = rows.argmax(dim=-1) if greedy_ids is None else greedy_ids[step.sample_rows]
            proposals = self._draft_rows(drafts, states, counts)
            tokens, accepted = accepted_block(argmax == proposals.flat, argmax, proposals)
        else:
            tokens, accepted = self._verified_rows(states, counts, rows, drafts)
        request_ids = [s.request_id for s in states]
        rejected = (to_device(counts, self.device) - accepted).int()
        return LaunchedStep(
            states,
            token_ids=tokens.gather(1, accepted.long().unsqueeze(1)).squeeze(1),
            emitted=DeviceDrafts(request_ids, [1 + n for n in counts], tokens),
            rollback=Rollback(request_ids, rejected),
        )

    def _verified_rows(
        self,
        states: list[RequestState],
        counts: list[int],
        rows: torch.Tensor,
        drafts: DeviceDrafts,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows with proposals verified, then the others sampled (as :meth:`_verified` does,
        so the draws are the same), into one ``[rows, 1 + max count]`` block of emitted
        tokens and the accepted counts."""
        starts, verified, index, plain = _verification_rows(counts)
        tokens = torch.zeros((len(states), 1 + max(counts)), dtype=torch.int64, device=self.device)
        accepted = torch.zeros(len(states), dtype=torch.int64, device=self.device)
        if verified:
            verified_states = [states[i] for i in verified]
            proposals = self._draft_rows(drafts, verified_states, [counts[i] for i in verified])
            block, num = verify_on_device(rows[index], verified_states, proposals, self.generator)
            at = to_device(verified, self.device)
            tokens[at, : block.shape[1]] = block
            accepted[at] = num.long()
        if plain:
            sampled = self.sampler.sample_on_device(
                rows[[starts[i] for i in plain]], [states[i] for i in plain], self.generator
            )
            tokens[to_device(plain, self.device), 0] = sampled.long()
        return tokens, accepted

    def _verified(
        self,
        plan: StepPlan,
        step: PreparedStep,
        logits: torch.Tensor,
        greedy_ids: torch.Tensor | None,
        drafts: DeviceDrafts | None,
    ) -> StepOutput:
        """A verification step's tokens, read at once: rows with proposals are verified, the
        others sampled as in any step (their one logits row). Plain greedy rows are accepted
        on the host from the step's argmax (the graph's own where it replayed one): one
        download (the proposals too where they are on the device), nothing uploaded."""
        states = step.sample_states
        counts = [plan.num_proposed(s.request_id) for s in states]
        starts, verified, index, plain = _verification_rows(counts)
        rows = logits[step.sample_rows]
        tokens: list[list[int]] = [[] for _ in states]
        logprobs: list[Logprob | None] = [None] * len(states)
        verified_states = [states[i] for i in verified]
        if plan.draft_token_ids:
            proposals = [plan.draft_token_ids[s.request_id] for s in verified_states]
        else:
            proposals = self._draft_rows(drafts, verified_states, [counts[i] for i in verified])
        if all(s.sampling_params.plain_argmax for s in verified_states):
            argmax = rows.argmax(dim=-1) if greedy_ids is None else greedy_ids[step.sample_rows]
            if isinstance(proposals, DraftRows):
                proposals, targets = proposals.download_with(argmax)
            else:
                targets = argmax.tolist()
            emitted = accept_greedy(proposals, [targets[r] for r in index])
        else:
            emitted = verify(rows[index], verified_states, proposals, self.generator)
        for i, row_tokens in zip(verified, emitted):
            tokens[i] = row_tokens
        if plain:
            bitmask = plan.token_bitmask
            sampled = self.sampler(
                rows[[starts[i] for i in plain]],
                [states[i] for i in plain],
                self.generator,
                None if bitmask is None else bitmask[plain],
            )
            for i, token_id, logprob in zip(plain, sampled.token_ids, sampled.logprobs):
                tokens[i], logprobs[i] = [token_id], logprob
        return StepOutput(
            [s.request_id for s in states],
            [t for row_tokens in tokens for t in row_tokens],
            logprobs,
            _prompt_logprobs(step, logits),
            [len(row_tokens) - 1 for row_tokens in tokens],
        )

    def _keep_accepted_states(
        self, plan: StepPlan, states: list[RequestState], output: StepOutput
    ) -> None:
        """Recurrent states go back to what the accepted tokens left (paged caches need
        nothing: refused positions are overwritten), and the runner's count of the tokens in
        each refusing row's caches to its accepted ones; the plan's ``copies_verified`` save
        the states at accepted tokens into checkpoints."""
        rows = {request_id: i for i, request_id in enumerate(plan.request_ids)}
        # each verifying row's place among the step's verifying rows (in row order)
        verifying = {r: j for j, r in enumerate(filter(plan.num_proposed, plan.request_ids))}
        tables, copies = self.inputs.tables, []
        num_accepted = {}
        for state, accepted in zip(states, output.num_accepted):
            request_id = state.request_id
            num_accepted[request_id] = accepted
            if accepted < plan.num_proposed(request_id):
                row = rows[request_id]
                tables.holds(request_id, plan.num_computed[row] + 1 + accepted)
                for owner, g in self._recurrent_owners:
                    slot = tables.first_block(request_id, g)
                    copies += owner.verified_state_copies(slot, verifying[request_id], accepted)
        for saves in plan.copies_verified:
            owners = [owner for owner, g in self._recurrent_owners if g == saves.group]
            for request_id, position, checkpoint in zip(
                saves.request_ids, saves.positions, saves.destinations
            ):
                if position <= num_accepted[request_id]:
                    for owner in owners:
                        copies += owner.verified_state_copies(
                            checkpoint, verifying[request_id], position
                        )
        if copies:
            torch._foreach_copy_(*map(list, zip(*copies)))

    def _fill_pending_tokens(
        self, token_ids: torch.Tensor, sources: list[tuple[int, int]], sampled: torch.Tensor
    ) -> None:
        """``token_ids[offset] = sampled[row]`` on the device for each ``(offset, row)``."""
        m = len(sources)
        if sources[-1] == (m - 1, m - 1) and all(d == s for d, s in sources):
            # The same requests in the same rows as last step: one copy, no index upload.
            token_ids[:m].copy_(sampled[:m])
            return
        index = to_device(sources, self.device)
        token_ids[index[:, 0]] = sampled[index[:, 1]].to(token_ids.dtype)

    def _fill_draft_tokens(
        self, token_ids: torch.Tensor, sources: list[tuple[int, str, int]], drafts: DeviceDrafts
    ) -> None:
        """``token_ids[offset + j] = drafts.tokens[row, j]`` on the device, ``j < count``, for
        each ``(offset, request_id, count)``, the row being the request's."""
        row_of, width = drafts.rows, drafts.tokens.shape[1]
        n, lead = len(sources), sources[0][0]
        q = len(token_ids) // n
        if (
            q * n == len(token_ids)
            and lead + width <= q
            and all(
                offset == i * q + lead and row_of[request_id] == i and count == width
                for i, (offset, request_id, count) in enumerate(sources)
            )
        ):
            # Every row's whole row of drafts at one place in rows of one length (uniform
            # steps): one copy, no index upload.
            token_ids.view(n, q)[:, lead : lead + width].copy_(drafts.tokens[:n])
            return
        pairs = [
            (offset + j, row_of[request_id] * width + j)
            for offset, request_id, count in sources
            for j in range(count)
        ]
        index = to_device(pairs, self.device)
        token_ids[index[:, 0]] = drafts.tokens.flatten()[index[:, 1]].to(token_ids.dtype)

    def _draft_rows(
        self, drafts: DeviceDrafts, states: list[RequestState], counts: list[int]
    ) -> DraftRows:
        """The first ``counts[i]`` proposals of ``states[i]``'s row of ``drafts``, gathered
        into the layout verification reads (each row followed by -1), on the device."""
        tokens = drafts.tokens
        width = tokens.shape[1] + 1
        ended = torch.cat([tokens, tokens.new_full((tokens.shape[0], 1), -1)], dim=1).flatten()
        row_of = drafts.rows
        if all(
            row_of.get(state.request_id) == i and n == width - 1
            for i, (state, n) in enumerate(zip(states, counts))
        ):  # every row whole and in its place (uniform steps): no index upload
            return DraftRows(counts, ended[: len(states) * width])
        # (a row without proposals needs only a -1: any row's last column)
        index = [
            (row_of[state.request_id] if n else 0) * width + j
            for state, n in zip(states, counts)
            for j in (*range(n), width - 1)
        ]
        return DraftRows(counts, ended[to_device(index, self.device)])


def _verification_rows(counts: Sequence[int]) -> tuple[list[int], list[int], list[int], list[int]]:
    """For the sampled rows of a verification step with ``counts[i]`` proposals each: each
    row's first logits row, the rows that verify, their logits rows, and the rows sampled
    plainly (no proposals)."""
    starts = [0, *accumulate(1 + n for n in counts)]
    verified = [i for i, n in enumerate(counts) if n]
    index = [r for i in verified for r in range(starts[i], starts[i + 1])]
    return starts, verified, index, [i for i, n in enumerate(counts) if not n]


def _rejected_per_row(request_ids: list[str], rollback: Rollback) -> torch.Tensor | None:
    """Each row's refused count in ``rollback`` (0 for a request it lacks), on the device;
    None where it has none of the rows."""
    rows = rollback.rows
    index = [rows.get(request_id, -1) for request_id in request_ids]
    if max(index) < 0:
        return None
    if index == list(range(len(rollback.request_ids))):
        return rollback.num_rejected
    rejected = rollback.num_rejected
    padded = torch.cat([rejected, rejected.new_zeros(1)])
    return padded[to_device([i if i >= 0 else len(rejected) for i in index], rejected.device)]


def _prompt_logprobs(step: PreparedStep, logits: torch.Tensor) -> dict[str, list[Logprob]]:
    """The logprobs of the prompt positions the step computed, per request."""
    prompt_lps: dict[str, list[Logprob]] = {}
    for state, row, position, count in step.prompt_rows:
        next_ids = state.all_token_ids[position + 1 : position + 1 + count]
        top = state.sampling_params.prompt_logprobs
        lps = prompt_logprobs(logits[row : row + count], next_ids, top)
        prompt_lps.setdefault(state.request_id, []).extend(lps)
    return prompt_lps


def apply_plan(
    plan: StepPlan,
    requests: dict[str, RequestState],
    tables: BlockTableRows,
    device: torch.device,
) -> None:
    """Bring the per-request state and block tables up to the plan."""
    for request_id in plan.finished_ids:
        requests.pop(request_id, None)
        tables.drop(request_id)
    for request_id in plan.preempted_ids:
        tables.drop(request_id)
    for new in plan.new_requests:
        requests[new.request_id] = RequestState(new, device)
    given_rows = [u.request_id for u in plan.table_updates if tables.apply(u)]
    if given_rows:
        # A request given a row (new, or back from preemption) holds its computed prefix:
        # cached blocks, and the states that the plan's copies_before restore.
        computed = dict(zip(plan.request_ids, plan.num_computed))
        for request_id in given_rows:
            tables.holds(request_id, computed.get(request_id, 0))
