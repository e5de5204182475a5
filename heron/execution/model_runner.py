"""ModelRunner: one step of the model, from a step plan to sampled tokens."""

from __future__ import annotations

import dataclasses
import gc
import logging
from collections.abc import Callable, Sequence
from functools import partial

import torch
from torch import nn

from heron.cache.layout import CacheLayout
from heron.cache.recurrent import RecurrentStateSpec
from heron.cache.spec import CacheSpec
from heron.config import ModelConfig
from heron.execution.cuda_graph import CudaGraphRunner
from heron.execution.launched import LaunchedStep
from heron.execution.multimodal import MultimodalInputs
from heron.execution.next_decode import DecodeChainer
from heron.execution.pooler import Pooler
from heron.execution.request_state import RequestState
from heron.execution.sampler import Sampler, on_device, to_device
from heron.execution.step_inputs import BlockTableRows, PreparedStep, StepInputBuilder
from heron.execution.step_plan import DeviceDrafts, Rollback, StepOutput, StepPlan
from heron.execution.verify import Verifier, rejected_per_row
from heron.kv_transfer import KVConnectorMeta, KVConnectorWorker, LayerSteps, TransferResults
from heron.loader.update import WeightSource, update_weights
from heron.lora.attach import lora_layers
from heron.lora.config import LoRAConfig
from heron.lora.request import LoRARequest
from heron.lora.slots import AdapterSlots
from heron.metadata import (
    GraphSupport,
    MetadataOperator,
    SequenceMetadata,
    StepBatch,
    StepMetadataError,
)
from heron.models.build import BuiltModel, build_model, build_pooling_model
from heron.parallel import SINGLE, TensorParallel
from heron.platforms import Platform
from heron.pooler_config import PoolerConfig

logger = logging.getLogger(__name__)


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
        lora: LoRAConfig | None = None,
        pooling: PoolerConfig | None = None,
    ) -> None:
        """Under ``tp`` the runner holds this rank's shard of the model and of the caches.
        ``build`` makes the model and its plan (``build_model``'s arguments; an MTP head's is
        another); with ``lora`` it serves LoRA adapters. With ``pooling`` it runs a pooling
        model: its steps pool, never sample."""
        if pooling is not None:
            build = partial(build_pooling_model, pooling=pooling)
        self.pooler = None if pooling is None else Pooler(pooling.pooling_type)
        self.model_config = model_config
        self.platform = platform
        self.device = platform.device
        self.block_size = block_size
        platform.note_memory_baseline()
        self.model, self.plan = build(
            model_config, platform, attention_backend, block_size, tp, lora
        )
        # A multimodal model's step inputs beside the tokens (its encoder cache with them).
        self.multimodal = (
            MultimodalInputs(self.model, self.device)
            if getattr(self.model, "is_multimodal", False)
            else None
        )
        self.adapters = None
        if lora is not None:
            packed = getattr(self.model, "packed_modules", {})
            renames = getattr(self.model, "checkpoint_renames", {})
            self.adapters = AdapterSlots(lora_layers(self.model), lora, packed, renames)
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
        self.inputs = StepInputBuilder(
            block_size, self.device, self.cache_specs, adapters=lora is not None
        )
        self.verifier = Verifier(
            self.sampler, self.generator, self.inputs.tables, self._recurrent_owners, self.device
        )
        self.decode_chain = DecodeChainer(block_size, self.device)
        self.graphs: CudaGraphRunner | None = None
        self.requests: dict[str, RequestState] = {}
        self._coverage_checked = False
        # Whether each LaunchedStep carries the step's hidden states (for an MTP head).
        self.keep_hidden_states = False
        # Whether a verification step whose rows all sample on the device is left there (read
        # later; the engine sets it where every operator reads lengths only on the device).
        self.async_verification = False
        self.kv_connector: KVConnectorWorker | None = None
        self.layer_steps: LayerSteps | None = None
        self._transfer_failures = TransferResults()
        self._loaded: set[str] = set()  # requests whose loads ended, until they run

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
            if id(group) in group_of:  # (the LoRA layers' group reads no cache)
                group.builder.cache_group = group_of[id(group)]

    def add_lora(self, request: LoRARequest) -> None:
        """Read and check an adapter before a request uses it (``ValueError`` if it does not
        fit the model, or the runner serves none)."""
        if self.adapters is None:
            raise ValueError(
                f"lora_request {request.lora_name!r}: the engine serves no LoRA adapters "
                "(enable_lora=False)"
            )
        self.adapters.add(request)

    def remove_lora(self, lora_int_id: int) -> None:
        if self.adapters is not None:
            self.adapters.remove(lora_int_id)

    def allocate_kv_cache(self, num_blocks: list[int]) -> None:
        """Every cache owner's tensor, sized to its cache group's pool."""
        self.num_blocks = list(num_blocks)
        self.cache.allocate(num_blocks, self.device)

    def release_device_state(self) -> None:
        """Sleep mode: drop the KV caches and what reads them or the weights (graphs and their
        buffers, the last step's views, a decode chain), so their device memory is freed; the
        weights are the engine's to release (:class:`heron.execution.sleep.ReleasedWeights`)."""
        if self.requests:
            raise RuntimeError(f"{len(self.requests)} requests still hold this runner's rows")
        if self.graphs is not None:
            self.graphs.release()
        for group in self.plan.groups:
            group.view = None
        self.decode_chain.reset()
        self.cache.release()

    def restore_kv_cache(self) -> None:
        """The KV caches again, zeroed, over the same pools."""
        self.cache.allocate(self.num_blocks, self.device)

    def rebuild_graphs(self) -> None:
        """Once the weights and caches are back: every graph recaptured over them, with fresh
        buffers (a no-op without graphs)."""
        if self.graphs is not None:
            self.graphs.rebuild(self.block_size, self.inputs.parts)

    def update_weights(self, source: WeightSource, also: Sequence[nn.Module] = ()) -> int:
        """Write ``source``'s tensors in place into this runner's model and ``also`` (an MTP
        head: it takes the tensors the model skips); see :func:`heron.loader.update.update_weights`."""
        return update_weights([self.model, *also], source.read)

    def set_kv_connector(self, connector: KVConnectorWorker) -> None:
        """Carry out ``connector``'s transfers around each step, over the allocated caches; a
        layerwise one waits on the layer steps each cache owner records after its forward."""
        self.kv_connector = connector
        self.layer_steps = LayerSteps(len(self.cache.owners), self.device)
        if connector.layerwise:
            for owner in self.cache.owners:
                owner.register_forward_hook(lambda *_: self.layer_steps.record())
        connector.register_caches(self.cache, self.layer_steps)

    def take_transfer_results(self) -> TransferResults:
        """The connector's transfers ended or failed since the last call."""
        results, self._transfer_failures = self._transfer_failures, TransferResults()
        ended = self.kv_connector.take_results()
        for name in ("loaded", "failed_loads", "failed_saves"):
            getattr(results, name).extend(getattr(ended, name))
        self._loaded.update(results.loaded)
        return results

    def _transfer(self, meta: KVConnectorMeta, loads: bool) -> None:
        """The connector's loads (before the forward pass) or saves (after it); an exception
        fails them, never the step."""
        try:
            if loads:
                self.kv_connector.start_step(meta)
            else:
                self.kv_connector.end_step(meta)
        except Exception:
            logger.exception("KV connector: the step's %s failed", "loads" if loads else "saves")
            if loads:
                self._transfer_failures.failed_loads.extend(meta.load_requests)
            else:
                self._transfer_failures.failed_saves.extend(meta.save_keys)

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
        """Stop the KV connector's work beside the runner (a tensor-parallel runner stops
        its workers here)."""
        if self.kv_connector is not None:
            self.kv_connector.shutdown()

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
        if step.adapter_slots is not None:  # under an adapter: the LoRA paths' buffers count
            step.adapter_slots[0] = 1  # (slot 1 holds zeros until an adapter is assigned)
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
        """From now on, where every cache allows it, a decode step launched right after one of
        the same rows (a proposer's pass) is prepared on the device from it, in chains of
        ``length`` steps computed at once (:class:`DecodeChainer`)."""
        self.decode_chain.enable(length, self.cache_specs)

    @property
    def verify_graph_max_batch(self) -> int:
        """The largest verification step (in rows) that replays a graph; 0 without such
        graphs."""
        if self.graphs is None or self.graphs.query_lens[-1] == 1:
            return 0
        return self.graphs.buckets_of[self.graphs.query_lens[-1]][-1]

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
        transfers = plan.kv_connector
        if transfers is not None:
            self._transfer(transfers, loads=True)
        step, rejected = self._prepare(plan, previous, drafts, rollback)
        if step is None:  # (a plan that only brings the runner's requests up to date)
            launched = LaunchedStep([], result=StepOutput([], [], []))
        elif self.pooler is not None:
            launched = self._pool(plan, step)
        else:
            hidden, logits, greedy_ids = self._run(plan, step)
            launched = self._sample_or_verify(plan, step, logits, greedy_ids, drafts, rejected)
            launched.hidden_states = hidden if self.keep_hidden_states else None
        if transfers is not None:
            self._transfer(transfers, loads=False)
        return launched

    def _prepare(
        self,
        plan: StepPlan,
        previous: LaunchedStep | None,
        drafts: DeviceDrafts | None,
        rollback: Rollback | None,
    ) -> tuple[PreparedStep | None, torch.Tensor | None]:
        """The step's inputs on the device (None for a plan without rows): derived from
        ``previous``'s where it chains, else packed from the plan, with the pending tokens
        and proposals written in and the rows moved back by the rollback; and each row's
        refused count in that rollback (None: none)."""
        step = self.decode_chain.prepare(plan, previous, drafts, rollback, self.inputs.tables)
        if step is not None:
            return step, None
        apply_plan(plan, self.requests, self.inputs.tables, self.device, self._loaded)
        if self.multimodal is not None:
            for request_id in plan.finished_ids:
                self.multimodal.forget(request_id, finished=True)
            for request_id in plan.preempted_ids:
                self.multimodal.forget(request_id, finished=False)
        if not plan.request_ids:
            return None, None
        slots = None
        if self.adapters is not None:
            slots = self.adapters.assign([self.requests[r].lora_request for r in plan.request_ids])
        step = self.inputs.prepare(plan, self.requests, previous.rows if previous else None, slots)
        token_ids = step.seq.token_ids
        if step.pending_sources:
            self._fill_pending_tokens(token_ids, step.pending_sources, previous.token_ids)
        if step.draft_sources:
            self.verifier.fill_drafts(token_ids, step.draft_sources, drafts)
        if rollback is None and previous is not None:
            rollback = previous.rollback
        rejected = None if rollback is None else rejected_per_row(plan.request_ids, rollback)
        if rejected is not None and not plan.device_inputs:
            self.verifier.move_back(plan, step.seq, rejected)
        return step, rejected

    def _run(
        self, plan: StepPlan, step: PreparedStep
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The forward pass between the plan's state copies (a graph's replay where one serves
        the step): every token's hidden states, the sampled rows' logits, and each row's
        greedy token where the graph drew them already."""
        seq = step.seq
        for copies in plan.copies_before:
            self.cache.copy_entries(copies.group, copies.sources, copies.destinations)
        greedy_ids = None
        # A step with images runs eagerly (the encoder, placeholder features, M-RoPE positions).
        mm = None if self.multimodal is None else self.multimodal.prepare(plan, self.requests)
        if mm is not None and mm.key_limits is not None:
            seq = dataclasses.replace(seq, key_limits=mm.key_limits)
        # A graph computes every token's logits: it serves steps that sample every token
        # (not a prefill chunk that samples nothing, nor prompt logprobs' rows first).
        every_token_sampled = step.sample_rows == slice(0, seq.num_tokens)
        if (
            self.graphs is not None
            and mm is None
            and every_token_sampled
            and self.graphs.can_run(seq)
        ):
            hidden, logits, greedy_ids = self.graphs.run(seq)
        else:
            if self.graphs is not None:
                logger.debug("eager step: %d requests, %d tokens", seq.num_reqs, seq.num_tokens)
            self.plan.build_views(seq)
            hidden = self.model(seq.token_ids) if mm is None else self.model(seq.token_ids, mm)
            logits = self.model.compute_logits(hidden[seq.logits_indices.long()])
        for copies in plan.copies_after:
            self.cache.copy_entries(copies.group, copies.sources, copies.destinations)
        return hidden, logits, greedy_ids

    def _pool(self, plan: StepPlan, step: PreparedStep) -> LaunchedStep:
        """A pooling step: the forward pass, then the head's output for each request whose
        last token it computed, on the host in float32."""
        seq = step.seq
        self.plan.build_views(seq)
        request_ids, pooled = self.pooler(plan, self.model(seq.token_ids))
        outputs = self.model.compute_logits(pooled).float().cpu()
        return LaunchedStep(
            [], result=StepOutput([], [], [], pooled=dict(zip(request_ids, outputs)))
        )

    def _sample_or_verify(
        self,
        plan: StepPlan,
        step: PreparedStep,
        logits: torch.Tensor,
        greedy_ids: torch.Tensor | None,
        drafts: DeviceDrafts | None,
        rejected: torch.Tensor | None,
    ) -> LaunchedStep:
        """The step's tokens: ingested verified blocks' or verified proposals' (the
        :class:`Verifier`), else sampled, left on the device where every row samples there."""
        seq, states, bitmask = step.seq, step.sample_states, plan.token_bitmask
        if plan.device_inputs:
            launched = self.verifier.ingest(plan, step, logits, greedy_ids, rejected)
            self.decode_chain.keep(launched, plan, seq, rejected)
        elif plan.verifies:
            keep = (
                self.async_verification
                and not plan.draft_token_ids
                and bitmask is None
                and _samples_on_device(step)
            )
            launched = self.verifier.verify(plan, step, logits, greedy_ids, drafts, keep)
        elif states and _samples_on_device(step):
            if greedy_ids is not None and all(s.sampling_params.plain_argmax for s in states):
                token_ids = greedy_ids[step.sample_rows]
            else:
                token_ids = self.sampler.sample_on_device(
                    logits[step.sample_rows], states, self.generator, bitmask
                )
            launched = LaunchedStep(states, token_ids=token_ids)
            if seq.is_decode and len(states) == seq.num_reqs:
                self.decode_chain.keep(launched, plan, seq)
        else:
            token_ids, logprobs = [], []
            if states:
                sampled = self.sampler(logits[step.sample_rows], states, self.generator, bitmask)
                token_ids, logprobs = sampled.token_ids, sampled.logprobs
            request_ids = [s.request_id for s in states]
            output = StepOutput(request_ids, token_ids, logprobs, step.prompt_logprobs(logits))
            launched = LaunchedStep(states, result=output)
        return launched

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


def _samples_on_device(step: PreparedStep) -> bool:
    """No prompt logprobs are due and every sampled row samples on the device."""
    return not step.prompt_rows and all(map(on_device, step.sample_states))


def apply_plan(
    plan: StepPlan,
    requests: dict[str, RequestState],
    tables: BlockTableRows,
    device: torch.device,
    loaded: set[str] | None = None,
) -> None:
    """Bring the per-request state and block tables up to the plan; ``loaded``: requests
    whose KV connector loads ended (their caches hold their context once they run)."""
    for request_id in plan.finished_ids:
        requests.pop(request_id, None)
        tables.drop(request_id)
    for request_id in plan.preempted_ids:
        tables.drop(request_id)
    if loaded:
        loaded.difference_update(plan.finished_ids, plan.preempted_ids)
        for request_id, num_computed in zip(plan.request_ids, plan.num_computed):
            if request_id in loaded:
                loaded.remove(request_id)
                tables.holds(request_id, num_computed)
    for new in plan.new_requests:
        requests[new.request_id] = RequestState(new, device)
    given_rows = [u.request_id for u in plan.table_updates if tables.apply(u)]
    if given_rows:
        # A request given a row (new, or back from preemption) holds its computed prefix:
        # cached blocks, and the states that the plan's copies_before restore.
        computed = dict(zip(plan.request_ids, plan.num_computed))
        for request_id in given_rows:
            tables.holds(request_id, computed.get(request_id, 0))
