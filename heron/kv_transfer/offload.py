"""Host-memory offload: the ``offload`` connector.

Every full block a step computes is saved, after the step, into a slot of a host pool
(pinned on CUDA), keyed by the block's chain hash; the pool keeps the most recently used
blocks within the bytes given. A hybrid model's state checkpoints (a recurrent group's) are
saved likewise into a second pool, keyed by the hash of the prefix they end. A prefix that
left the device pool is found there: its blocks (and the state where it ends) are loaded
into fresh device blocks (and the request's state slot) before the request computes the
rest, instead of being recomputed. Its scheduler side (:class:`OffloadScheduler`) keeps the
pools' indexes; its worker side (:class:`OffloadWorker`) holds the host tensors and copies.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Container, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from heron.cache.block_pool import NULL_BLOCK_ID, hash_block_tokens
from heron.kv_transfer.base import (
    ConnectorMetric,
    ExternalHits,
    InFlightLoads,
    KVConnectorMeta,
    KVConnectorScheduler,
    KVConnectorWorker,
    TransferResults,
)

if TYPE_CHECKING:
    from heron.cache.layout import CacheLayout
    from heron.cache.manager import CachedSequence, StateCopies
    from heron.kv_transfer.layer_steps import LayerSteps

logger = logging.getLogger(__name__)


class CheckpointTier(NamedTuple):
    """The host pool of state checkpoints: ``num_slots`` of ``bytes_per_slot``, for the
    checkpoints of cache group ``group``."""

    group: int
    num_slots: int
    bytes_per_slot: int


@dataclass(frozen=True)
class OffloadMeta(KVConnectorMeta):
    """A step's copies: host slot ``load_slots[i]`` into device blocks ``load_blocks[i]``
    (one per paged cache group) before the forward pass; device blocks ``save_blocks[i]``
    into host slot ``save_slots[i]`` (holding block hash ``save_keys[i]``) after it.
    ``freed_*``: saves of blocks their requests gave back, made before the loads (the pool
    may hand those blocks out in this step). State checkpoints: ``state_loads`` (host slot,
    device entry: a loading request's slot) before the forward pass, ``state_saves``
    (device entry, host slot, hash) after it, ``early_state_saves`` before it (checkpoints
    written by earlier steps, whose entries this step may reuse)."""

    load_slots: list[int] = field(default_factory=list)
    load_blocks: list[list[int]] = field(default_factory=list)
    save_slots: list[int] = field(default_factory=list)
    save_blocks: list[list[int]] = field(default_factory=list)
    freed_slots: list[int] = field(default_factory=list)
    freed_blocks: list[list[int]] = field(default_factory=list)
    freed_keys: list[int] = field(default_factory=list)
    state_loads: list[tuple[int, int]] = field(default_factory=list)
    state_saves: list[tuple[int, int, int]] = field(default_factory=list)
    early_state_saves: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def state_keys(self) -> list[int]:
        return [h for *_, h in self.state_saves + self.early_state_saves]


class HostBlockIndex:
    """Which block hashes the host pool's ``num_slots`` slots hold, least recently used
    first: adding to a full pool evicts the head."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._slot_of: OrderedDict[int, int] = OrderedDict()
        self._free = list(range(num_slots - 1, -1, -1))
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._slot_of

    def use(self, block_hash: int) -> int:
        """The slot holding ``block_hash``, now the most recently used."""
        self._slot_of.move_to_end(block_hash)
        return self._slot_of[block_hash]

    def add(self, block_hash: int, busy: Container[int] = ()) -> int | None:
        """A slot for ``block_hash`` (not held yet): a free one, else that of the least
        recently used hash not in ``busy`` (being loaded); None if every one is."""
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((h for h in self._slot_of if h not in busy), None)
            if victim is None:
                return None
            slot = self._slot_of.pop(victim)
            self.num_evicted += 1
        self._slot_of[block_hash] = slot
        return slot

    def discard(self, block_hash: int) -> None:
        """Forget ``block_hash`` (its slot's content is not to be trusted)."""
        slot = self._slot_of.pop(block_hash, None)
        if slot is not None:
            self._free.append(slot)

    def check_invariants(self) -> None:
        slots = list(self._slot_of.values())
        if len(set(slots)) != len(slots) or set(slots) & set(self._free):
            raise RuntimeError("host pool: a slot is held twice, or held and free")
        if len(slots) + len(self._free) != self.num_slots:
            raise RuntimeError(
                f"host pool: {len(slots)} held + {len(self._free)} free slots, not {self.num_slots}"
            )


class OffloadScheduler(KVConnectorScheduler):
    """The host pools' indexes, what each step loads and saves, and the tier's counters.

    A block being loaded is registered on the device as soon as its blocks are allocated;
    a request that would hit it there waits a step (:class:`ExternalHits` ``wait``), until
    the load has ended (or failed, or outlasted ``load_timeout_s``, and the blocks were
    dropped). Host slots being loaded are never handed to a save. With ``checkpoints``
    (a hybrid model), a load ends where the host holds a state: the prefix's blocks of the
    ``paged_groups`` and the state at its end are loaded."""

    def __init__(
        self,
        num_slots: int,
        block_size: int,
        bytes_per_slot: int,
        paged_groups: Sequence[int] = (0,),
        checkpoints: CheckpointTier | None = None,
        load_timeout_s: float = float("inf"),
    ) -> None:
        self.index = HostBlockIndex(num_slots)
        self.block_size = block_size
        self.bytes_per_slot = bytes_per_slot
        self.paged_groups = list(paged_groups)
        self.checkpoints = checkpoints
        self.states = None if checkpoints is None else HostBlockIndex(checkpoints.num_slots)
        self.in_flight = InFlightLoads(load_timeout_s)
        self._offered: dict[str, int] = {}  # request -> its blocks offered for saving
        self._looked_up: tuple[str, list[int]] = ("", [])  # the last lookup's chain
        self._meta = OffloadMeta()
        self.stored_blocks = 0
        self.loaded_blocks = 0
        self.failed_loads = 0
        self.stored_states = 0
        self.loaded_states = 0

    def lookup(self, request: CachedSequence, num_device_tokens: int) -> ExternalHits:
        if request.wants_prompt_logprobs:
            return ExternalHits(0)
        bs, tokens, in_flight = self.block_size, request.all_token_ids, self.in_flight
        first = num_device_tokens // bs
        hashes: list[int] = []
        parent = request.prefix_root
        for i in range((len(tokens) - 1) // bs):
            parent = hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs])
            if i < first:
                if parent in in_flight:
                    return ExternalHits(0, wait=True)
            elif parent not in self.index:
                break
            hashes.append(parent)
        if self.states is not None:  # (a load ends where the host holds the state)
            while len(hashes) > first and hashes[-1] not in self.states:
                hashes.pop()
        self._looked_up = (request.request_id, hashes)
        return ExternalHits((len(hashes) - first) * bs)

    def load(
        self,
        request: CachedSequence,
        tables: Sequence[Sequence[int]],
        num_device_tokens: int,
        num_tokens: int,
    ) -> None:
        request_id, hashes = self._looked_up
        first = num_device_tokens // self.block_size
        end = first + num_tokens // self.block_size
        if request_id != request.request_id or len(hashes) < end:
            raise RuntimeError(f"request {request.request_id}: load without its lookup")
        meta, loading = self._meta, hashes[first:end]
        for i, block_hash in enumerate(loading, first):
            meta.load_slots.append(self.index.use(block_hash))
            meta.load_blocks.append([tables[g][i] for g in self.paged_groups])
        if self.states is not None:
            slot = self.states.use(loading[-1])
            meta.state_loads.append((slot, tables[self.checkpoints.group][0]))
        meta.load_requests.append(request.request_id)
        self.in_flight.start(request.request_id, loading)

    def scheduled(
        self,
        request: CachedSequence,
        tables: Sequence[Sequence[int]],
        hashes: Sequence[int],
        num_new: int,
    ) -> None:
        meta = self._meta
        self._offer(
            request.request_id, tables, hashes, meta.save_slots, meta.save_blocks, meta.save_keys
        )

    def freed(
        self, request: CachedSequence, tables: Sequence[Sequence[int]], hashes: Sequence[int]
    ) -> None:
        # Only computed blocks: a request freed while loading has registered its loads' too.
        hashes = hashes[: request.num_computed_tokens // self.block_size]
        meta = self._meta
        self._offer(
            request.request_id, tables, hashes, meta.freed_slots, meta.freed_blocks, meta.freed_keys
        )

    def _offer(
        self,
        request_id: str,
        tables: Sequence[Sequence[int]],
        hashes: Sequence[int],
        slots: list[int],
        blocks_out: list[list[int]],
        keys: list[int],
    ) -> None:
        """Save the request's blocks not offered before: their host slots, device blocks and
        hashes into ``slots``, ``blocks_out`` and ``keys`` (a hash already held is only
        touched)."""
        start = self._offered.get(request_id, 0)
        if len(hashes) <= start:
            return
        index = self.index
        for i in range(start, len(hashes)):
            block_hash = hashes[i]
            if block_hash in index:
                index.use(block_hash)
                continue
            blocks = [tables[g][i] for g in self.paged_groups]
            if NULL_BLOCK_ID in blocks:
                continue  # a window group released it: the block is not whole
            slot = index.add(block_hash, self.in_flight)
            if slot is None:
                continue  # every slot is being loaded
            slots.append(slot)
            blocks_out.append(blocks)
            keys.append(block_hash)
            self.stored_blocks += 1
        self._offered[request_id] = len(hashes)

    def checkpointed(self, group: int, copies: StateCopies) -> None:
        if self.checkpoints is None or group != self.checkpoints.group:
            return
        self._offer_states(copies.registered, self._meta.state_saves)
        self._offer_states(copies.confirmed, self._meta.early_state_saves)

    def _offer_states(
        self, checkpoints: Sequence[tuple[int, int]], saves: list[tuple[int, int, int]]
    ) -> None:
        """Save the checkpoints ``(entry, hash)`` whose hash the host holds no state of yet."""
        states = self.states
        for entry, block_hash in checkpoints:
            if block_hash in states:
                states.use(block_hash)
                continue
            slot = states.add(block_hash, self.in_flight)
            if slot is not None:
                saves.append((entry, slot, block_hash))
                self.stored_states += 1

    def timed_out(self) -> list[str]:
        return self.in_flight.expired()

    def forget(self, request_id: str) -> None:
        self._offered.pop(request_id, None)
        self.in_flight.end(request_id)

    def finished(self, results: TransferResults) -> None:
        for request_id in results.failed_loads:  # (first: a failure outweighs a success)
            hashes = self.in_flight.end(request_id)
            self.failed_loads += bool(hashes)  # (not again for one given up already)
            self._discard(hashes)
        for request_id in results.loaded:
            hashes = self.in_flight.end(request_id)
            self.loaded_blocks += len(hashes)
            self.loaded_states += bool(hashes and self.states is not None)
        self._discard(results.failed_saves)

    def _discard(self, hashes: Sequence[int]) -> None:
        """Forget the host's blocks and states of ``hashes``."""
        for block_hash in hashes:
            self.index.discard(block_hash)
            if self.states is not None:
                self.states.discard(block_hash)

    def take_step_meta(self) -> OffloadMeta | None:
        meta = self._meta
        if not (meta.load_requests or meta.save_keys or meta.freed_keys or meta.state_keys):
            return None
        self._meta = OffloadMeta()
        return meta

    def describe(self) -> str:
        bs, n, tier = self.block_size, self.index.num_slots, self.checkpoints
        states = (
            ""
            if tier is None
            else f", {tier.num_slots} state checkpoints "
            f"({tier.num_slots * tier.bytes_per_slot / 2**30:.3f} GiB)"
        )
        return (
            f"host-memory offload: {n} blocks ({n * bs} tokens, "
            f"{n * self.bytes_per_slot / 2**30:.3f} GiB){states}, LRU"
        )

    def metrics(self) -> list[ConnectorMetric]:
        index = self.index
        metrics = [
            ConnectorMetric(
                "kv_offload_stored_blocks", "blocks saved to host memory", self.stored_blocks, True
            ),
            ConnectorMetric(
                "kv_offload_loaded_blocks",
                "blocks loaded from host memory instead of recomputed",
                self.loaded_blocks,
                True,
            ),
            ConnectorMetric(
                "kv_offload_failed_loads",
                "requests whose load from host memory failed (recomputed)",
                self.failed_loads,
                True,
            ),
            ConnectorMetric(
                "kv_offload_host_usage_perc",
                "fraction of the host pool's blocks holding KV (0-1)",
                len(index) / index.num_slots,
                False,
            ),
            ConnectorMetric(
                "kv_offload_host_total_blocks", "the host pool's blocks", index.num_slots, False
            ),
        ]
        if self.states is not None:
            metrics += [
                ConnectorMetric(
                    "kv_offload_stored_checkpoints",
                    "state checkpoints saved to host memory",
                    self.stored_states,
                    True,
                ),
                ConnectorMetric(
                    "kv_offload_loaded_checkpoints",
                    "state checkpoints loaded from host memory instead of recomputed",
                    self.loaded_states,
                    True,
                ),
                ConnectorMetric(
                    "kv_offload_host_checkpoint_usage_perc",
                    "fraction of the host pool's state checkpoints holding a state (0-1)",
                    len(self.states) / self.states.num_slots,
                    False,
                ),
            ]
        return metrics

    def check_invariants(self) -> None:
        self.index.check_invariants()
        if self.states is not None:
            self.states.check_invariants()
        self.in_flight.check_invariants("offload")


class OffloadWorker(KVConnectorWorker):
    """The host pools' tensors (one per paged cache owner, ``num_slots`` blocks each; one per
    state tensor of a recurrent owner, ``num_state_slots`` entries each) and the copies. On
    CUDA a step's saves are gathered on the device and copied into pinned memory without
    waiting; they are placed into their slots before the pools are next read or written."""

    def __init__(self, num_slots: int, num_state_slots: int = 0) -> None:
        self.num_slots = num_slots
        self.num_state_slots = num_state_slots
        # (device cache, host pool, block axis, ordinal among the paged groups) per layer
        self._layers: list[tuple[torch.Tensor, torch.Tensor, int, int]] = []
        self._states: list[tuple[torch.Tensor, torch.Tensor]] = []  # (device, host), axis 0
        self._device = torch.device("cpu")
        self._results = TransferResults()
        # (event, [(host, axis, host slots, gathered)]): saves copied out, not placed yet
        self._pending: tuple | None = None

    def register_caches(self, layout: CacheLayout, layer_steps: LayerSteps) -> None:
        self._layers, self._states = [], []
        paged = [g for g, spec in enumerate(layout.specs) if not spec.per_request]
        for owner, group, cache in zip(layout.owners, layout.owner_groups, layout.caches):
            spec = owner.cache_spec
            if spec.per_request:
                for tensor in cache:
                    shape = (self.num_state_slots, *tensor.shape[1:])
                    host = torch.empty(shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
                    self._states.append((tensor, host))
            else:
                host = torch.empty(
                    spec.tensor_shape(self.num_slots), dtype=spec.dtype, pin_memory=cache.is_cuda
                )
                self._layers.append((cache, host, spec.block_axis, paged.index(group)))
                self._device = cache.device

    def start_step(self, meta: OffloadMeta) -> None:
        self._place_saves()
        if meta.freed_slots or meta.early_state_saves:  # (before the loads: they may write
            try:  # into these blocks)
                self._save(meta.freed_slots, meta.freed_blocks, meta.early_state_saves)
                if meta.load_slots or meta.state_loads:
                    self._place_saves()  # (a load may read what they save)
            except Exception:
                self._results.failed_saves.extend(meta.freed_keys)
                self._results.failed_saves.extend(h for *_, h in meta.early_state_saves)
                raise
        device = self._device
        if meta.load_slots:
            slots = torch.tensor(meta.load_slots)
            blocks = torch.tensor(meta.load_blocks).T.to(device)
            for cache, host, axis, group in self._layers:
                cache.index_copy_(axis, blocks[group], _to_device(host, axis, slots, device))
        if meta.state_loads:
            slots, entries = torch.tensor(meta.state_loads).T
            entries = entries.to(device)
            for tensor, host in self._states:
                tensor.index_copy_(0, entries, _to_device(host, 0, slots, device))
        self._results.loaded.extend(meta.load_requests)

    def end_step(self, meta: OffloadMeta) -> None:
        self._place_saves()
        try:
            self._save(meta.save_slots, meta.save_blocks, meta.state_saves)
        except Exception:
            self._results.failed_saves.extend(h for *_, h in meta.state_saves)
            raise

    def _save(
        self, slots: list[int], blocks: list[list[int]], states: list[tuple[int, int, int]]
    ) -> None:
        """Copy device ``blocks`` (one per paged group each) into host ``slots``, and the
        state entries of ``states`` (entry, host slot, hash) into theirs: at once on the CPU,
        else staged in pinned memory without waiting (see :meth:`_place_saves`)."""
        staged = self._stage(slots, blocks, states)
        if staged and staged[0][3].is_pinned():
            event = torch.cuda.Event()
            event.record()
            self._pending = (event, staged)
        else:
            _scatter(staged)

    def _stage(
        self, slots: list[int], blocks: list[list[int]], states: list[tuple[int, int, int]]
    ) -> list[tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]]:
        """The saves' copies on their way to the host: (host pool, axis, its slots, what
        goes there)."""
        staged = []
        if slots:
            device_blocks = torch.tensor(blocks).T.to(self._device)
            host_slots = torch.tensor(slots)
            staged += [
                (host, axis, host_slots, _to_host(cache.index_select(axis, device_blocks[group])))
                for cache, host, axis, group in self._layers
            ]
        if states:
            entries = torch.tensor([e for e, _, _ in states]).to(self._device)
            state_slots = torch.tensor([slot for _, slot, _ in states])
            staged += [
                (host, 0, state_slots, _to_host(tensor.index_select(0, entries)))
                for tensor, host in self._states
            ]
        return staged

    def _place_saves(self) -> None:
        """Put the last step's saves, copied out without waiting, into their slots."""
        if self._pending is not None:
            event, staged = self._pending
            self._pending = None
            event.synchronize()
            _scatter(staged)

    def take_results(self) -> TransferResults:
        results, self._results = self._results, TransferResults()
        return results

    def shutdown(self) -> None:
        self._place_saves()


def _to_device(host: torch.Tensor, axis: int, slots: torch.Tensor, device) -> torch.Tensor:
    """``host``'s ``slots`` on ``device``: gathered into pinned memory (from a pinned pool) so
    that the copy to the device does not wait, nor go through the driver's bounce buffer."""
    shape = list(host.shape)
    shape[axis] = len(slots)
    staged = torch.empty(shape, dtype=host.dtype, pin_memory=host.is_pinned())
    return torch.index_select(host, axis, slots, out=staged).to(device, non_blocking=True)


def _to_host(gathered: torch.Tensor) -> torch.Tensor:
    return gathered.to("cpu", non_blocking=True)


def _scatter(staged: list[tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]]) -> None:
    for host, axis, slots, blocks in staged:
        host.index_copy_(axis, slots, blocks)
