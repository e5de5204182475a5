"""Host-memory offload: the ``offload`` connector.

Every full block a step computes is saved, after the step, into a slot of a host pool
(pinned on CUDA), keyed by the block's chain hash; the pool keeps the most recently used
blocks within the bytes given. A prefix that left the device pool is found there: its blocks
are loaded into fresh device blocks before the request computes the rest, instead of being
recomputed. Its scheduler side (:class:`OffloadScheduler`) keeps the pool's index; its worker
side (:class:`OffloadWorker`) holds the host tensors and copies the blocks.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

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
    from heron.cache.manager import CachedSequence
    from heron.kv_transfer.layer_steps import LayerSteps

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OffloadMeta(KVConnectorMeta):
    """A step's copies: host slot ``load_slots[i]`` into device blocks ``load_blocks[i]``
    (one per cache group) before the forward pass; device blocks ``save_blocks[i]`` into
    host slot ``save_slots[i]`` (holding block hash ``save_keys[i]``) after it. ``freed_*``:
    saves of blocks their requests gave back, made before the loads (the pool may hand those
    blocks out in this step)."""

    load_slots: list[int] = field(default_factory=list)
    load_blocks: list[list[int]] = field(default_factory=list)
    save_slots: list[int] = field(default_factory=list)
    save_blocks: list[list[int]] = field(default_factory=list)
    freed_slots: list[int] = field(default_factory=list)
    freed_blocks: list[list[int]] = field(default_factory=list)
    freed_keys: list[int] = field(default_factory=list)


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

    def add(self, block_hash: int) -> int:
        """A slot for ``block_hash`` (not held yet): a free one, else the least recently
        used one's."""
        if self._free:
            slot = self._free.pop()
        else:
            _, slot = self._slot_of.popitem(last=False)
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
    """The host pool's index, what each step loads and saves, and the tier's counters.

    A block being loaded is registered on the device as soon as its blocks are allocated;
    a request that would hit it there waits a step (:class:`ExternalHits` ``wait``), until
    the load has ended (or failed, and the blocks were dropped)."""

    def __init__(self, num_slots: int, block_size: int, bytes_per_slot: int) -> None:
        self.index = HostBlockIndex(num_slots)
        self.block_size = block_size
        self.bytes_per_slot = bytes_per_slot
        self._in_flight = InFlightLoads()
        self._offered: dict[str, int] = {}  # request -> its blocks offered for saving
        self._looked_up: tuple[str, list[int]] = ("", [])  # the last lookup's chain
        self._meta = OffloadMeta()
        self.stored_blocks = 0
        self.loaded_blocks = 0
        self.failed_loads = 0

    def lookup(self, request: CachedSequence, num_device_tokens: int) -> ExternalHits:
        if request.wants_prompt_logprobs:
            return ExternalHits(0)
        bs, tokens, in_flight = self.block_size, request.all_token_ids, self._in_flight
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
            meta.load_blocks.append([table[i] for table in tables])
        meta.load_requests.append(request.request_id)
        self._in_flight.start(request.request_id, loading)

    def scheduled(
        self, request: CachedSequence, tables: Sequence[Sequence[int]], hashes: Sequence[int]
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
            blocks = [table[i] for table in tables]
            if NULL_BLOCK_ID in blocks:
                continue  # a window group released it: the block is not whole
            slots.append(index.add(block_hash))
            blocks_out.append(blocks)
            keys.append(block_hash)
            self.stored_blocks += 1
        self._offered[request_id] = len(hashes)

    def forget(self, request_id: str) -> None:
        self._offered.pop(request_id, None)
        self._in_flight.end(request_id)

    def finished(self, results: TransferResults) -> None:
        for request_id in results.failed_loads:  # (first: a failure outweighs a success)
            self.failed_loads += 1
            for block_hash in self._in_flight.end(request_id):
                self.index.discard(block_hash)
        for request_id in results.loaded:
            self.loaded_blocks += len(self._in_flight.end(request_id))
        for block_hash in results.failed_saves:
            self.index.discard(block_hash)

    def take_step_meta(self) -> OffloadMeta | None:
        meta = self._meta
        if not (meta.load_requests or meta.save_keys or meta.freed_keys):
            return None
        self._meta = OffloadMeta()
        return meta

    def describe(self) -> str:
        bs, n = self.block_size, self.index.num_slots
        return (
            f"host-memory offload: {n} blocks ({n * bs} tokens, "
            f"{n * self.bytes_per_slot / 2**30:.3f} GiB)"
        )

    def metrics(self) -> list[ConnectorMetric]:
        index = self.index
        return [
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

    def check_invariants(self) -> None:
        self.index.check_invariants()
        self._in_flight.check_invariants("offload")


class OffloadWorker(KVConnectorWorker):
    """The host pool's tensors (one per cache owner, ``num_slots`` blocks each) and the
    copies. On CUDA a step's saves are gathered on the device and copied into pinned memory
    without waiting; they are placed into their slots before the pool is next read or
    written."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._layers: list[tuple[torch.Tensor, torch.Tensor, int, int]] = []
        self._results = TransferResults()
        # (event, slots, per layer (host, axis, blocks)): saves copied out, not placed yet
        self._pending: tuple | None = None

    def register_caches(self, layout: CacheLayout, layer_steps: LayerSteps) -> None:
        self._layers = []
        for owner, group, cache in zip(layout.owners, layout.owner_groups, layout.caches):
            spec = owner.cache_spec
            host = torch.empty(
                spec.tensor_shape(self.num_slots),
                dtype=spec.dtype,
                pin_memory=cache.is_cuda,
            )
            self._layers.append((cache, host, spec.block_axis, group))

    def start_step(self, meta: OffloadMeta) -> None:
        self._place_saves()
        if meta.freed_slots:  # (before the loads: they may write into these blocks)
            try:
                self._save(meta.freed_slots, meta.freed_blocks)
                if meta.load_slots:
                    self._place_saves()  # (a load may read what they save)
            except Exception:
                self._results.failed_saves.extend(meta.freed_keys)
                raise
        if meta.load_slots:
            slots = torch.tensor(meta.load_slots)
            blocks = torch.tensor(meta.load_blocks).T
            device = self._layers[0][0].device
            blocks = blocks.to(device)
            for cache, host, axis, group in self._layers:
                cache.index_copy_(axis, blocks[group], host.index_select(axis, slots).to(device))
        self._results.loaded.extend(meta.load_requests)

    def end_step(self, meta: OffloadMeta) -> None:
        self._place_saves()
        if meta.save_slots:
            self._save(meta.save_slots, meta.save_blocks)

    def _save(self, slots: list[int], blocks: list[list[int]]) -> None:
        """Copy device ``blocks`` (one per cache group each) into host ``slots``: at once on
        the CPU, else staged in pinned memory without waiting (see :meth:`_place_saves`)."""
        device_blocks = torch.tensor(blocks).T.to(self._layers[0][0].device)
        host_slots = torch.tensor(slots)
        staged = [
            (
                host,
                axis,
                cache.index_select(axis, device_blocks[group]).to("cpu", non_blocking=True),
            )
            for cache, host, axis, group in self._layers
        ]
        if staged[0][2].is_pinned():
            event = torch.cuda.Event()
            event.record()
            self._pending = (event, host_slots, staged)
        else:
            _scatter(host_slots, staged)

    def _place_saves(self) -> None:
        """Put the last step's saves, copied out without waiting, into their slots."""
        if self._pending is not None:
            event, slots, staged = self._pending
            self._pending = None
            event.synchronize()
            _scatter(slots, staged)

    def take_results(self) -> TransferResults:
        results, self._results = self._results, TransferResults()
        return results

    def shutdown(self) -> None:
        self._place_saves()


def _scatter(slots: torch.Tensor, staged: list[tuple[torch.Tensor, int, torch.Tensor]]) -> None:
    for host, axis, blocks in staged:
        host.index_copy_(axis, slots, blocks)
