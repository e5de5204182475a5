"""Prefill/decode disaggregation over NIXL: the ``nixl`` connector.

A ``prefill`` instance computes a request's prompt (and first token); when the request asks
for it (``kv_transfer_params: {"do_remote_decode": true}``) its blocks stay allocated after it
finished, and its answer's ``kv_transfer_params`` say where they are: the instance's NIXL
agent metadata, its cache layout (one memory region per cache layer) and the request's block
ids. A ``decode`` instance given those parameters allocates blocks for the prompt, reads them
with one NIXL READ whose notification tells the prefill side to free them, then computes the
prompt's last token itself and decodes. A model with recurrent layers also reads each layer's
state (conv and recurrent) after all but the prompt's last token, which the prefill side
keeps in an entry of its own (``Request.keep_state_at``). The prefill side frees blocks nobody
read after ``hold_timeout_s``; a read that fails or outlasts ``transfer_timeout_s`` is
recomputed on the decode side (the client gets the right answer, later) or, with
``on_read_failure: "abort"``, fails the request (the client gets the error at once).

Both halves live in the engine process and share one :class:`NixlAgent` (the scheduler side
reads its notifications): tensor parallelism is refused for every connector.
"""

from __future__ import annotations

import base64
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from heron.cache.block_pool import NULL_BLOCK_ID, hash_block_tokens
from heron.kv_transfer.base import (
    ConnectorMetric,
    ExternalHits,
    InFlightLoads,
    KVConnectorMeta,
    KVConnectorScheduler,
    KVConnectorWorker,
    KVTransferError,
    TransferResults,
)

if TYPE_CHECKING:
    from heron.cache.layout import CacheLayout
    from heron.cache.manager import CachedSequence
    from heron.kv_transfer.layer_steps import LayerSteps

logger = logging.getLogger(__name__)

# What a decode instance does with a request whose read failed or timed out: compute its
# prompt itself (the right answer, later), or fail it (the client gets the error at once).
READ_FAILURES = ("recompute", "abort")

# What a prefill instance's answer carries (vLLM's names, where it has them).
_DECODE_PARAMS = (
    "do_remote_prefill",
    "remote_engine_id",
    "remote_agent_metadata",
    "remote_layers",
    "remote_block_size",
    "remote_block_ids",
    "remote_request_id",
    "remote_num_tokens",
)


class LayerRegion(NamedTuple):
    """One cache tensor as NIXL sees it: ``num_prefixes`` runs of ``num_blocks``
    chunks of ``chunk_bytes`` from ``address`` (a block is one chunk of every run)."""

    address: int
    num_prefixes: int
    num_blocks: int
    chunk_bytes: int
    dtype: str
    group: int
    memory: str  # "DRAM" or "VRAM"
    device_id: int

    def chunks(self, block: int) -> list[tuple[int, int, int]]:
        """The (address, length, device) descriptors of ``block``."""
        return [
            (
                self.address + (p * self.num_blocks + block) * self.chunk_bytes,
                self.chunk_bytes,
                self.device_id,
            )
            for p in range(self.num_prefixes)
        ]


@dataclass
class TransferStats:
    """What the decode side read (the worker counts, the scheduler side reports)."""

    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0


class NixlAgent:
    """This instance's NIXL agent: its registered caches, the remote agents it met, and the
    read notifications it received (request ids whose blocks another instance has read)."""

    def __init__(self) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.engine_id = uuid.uuid4().hex
        self.agent = nixl_agent(self.engine_id, nixl_agent_config(backends=["UCX"]))
        self.layers: list[LayerRegion] = []
        self.stats = TransferStats()
        self._registered: list[Any] = []
        self._remotes: dict[str, str] = {}

    def register(self, layout: CacheLayout) -> None:
        for handle in self._registered:
            self.agent.deregister_memory(handle)
        self._registered, self.layers, seen = [], [], set()
        tensors = [
            (tensor, group, owner)
            for caches, group, owner in zip(layout.caches, layout.owner_groups, layout.owners)
            for tensor in (caches if isinstance(caches, tuple) else (caches,))
        ]  # (a recurrent layer's slot holds two: conv and recurrent state)
        for cache, group, owner in tensors:
            axis = owner.cache_spec.block_axis
            if not cache.is_contiguous():
                raise ValueError(
                    f"kv_transfer_config: {owner.layer_name}'s cache is not contiguous"
                )
            memory = "VRAM" if cache.is_cuda else "DRAM"
            if cache.data_ptr() not in seen:  # (layers sharing one cache register it once)
                seen.add(cache.data_ptr())
                self._registered.append(self.agent.register_memory(cache, memory))
            num_prefixes = 1
            for size in cache.shape[:axis]:
                num_prefixes *= size
            num_blocks = cache.shape[axis]
            self.layers.append(
                LayerRegion(
                    cache.data_ptr(),
                    num_prefixes,
                    num_blocks,
                    cache.numel() * cache.element_size() // (num_prefixes * num_blocks),
                    str(cache.dtype).removeprefix("torch."),
                    group,
                    memory,
                    cache.device.index or 0,
                )
            )

    @property
    def metadata(self) -> str:
        return base64.b64encode(self.agent.get_agent_metadata()).decode()

    def remote(self, engine_id: str, metadata: str) -> str:
        """The name of the remote agent ``engine_id`` (met once, then remembered)."""
        name = self._remotes.get(engine_id)
        if name is None:
            name = self.agent.add_remote_agent(base64.b64decode(metadata))
            name = name.decode() if isinstance(name, bytes) else name
            self._remotes[engine_id] = name
        return name

    def release_remote(self, params: dict) -> None:
        """Tell a prefill instance that its held blocks will not be read (they are freed
        there at their timeout if this fails)."""
        try:
            name = self.remote(params["remote_engine_id"], params["remote_agent_metadata"])
            self.agent.send_notif(name, params["remote_request_id"].encode())
        except Exception:
            logger.exception(
                "request %s: the prefill instance was not told", params["remote_request_id"]
            )

    def notifications(self) -> list[str]:
        return [m.decode() for ms in self.agent.get_new_notifs().values() for m in ms]

    def check_compatible(self, block_size: int, params: dict) -> None:
        """Raise ``ValueError`` naming where a prefill instance's cache differs from ours."""
        if params["remote_block_size"] != block_size:
            raise ValueError(
                f"kv_transfer_params: the prefill instance's block_size "
                f"({params['remote_block_size']}) differs from this decode instance's "
                f"({block_size}); give both the same --block-size"
            )
        remote = [LayerRegion(*layer) for layer in params["remote_layers"]]
        if len(remote) != len(self.layers):
            raise ValueError(
                f"kv_transfer_params: the prefill instance has {len(remote)} cache layers, "
                f"this decode instance {len(self.layers)} (not the same model)"
            )
        for i, (theirs, ours) in enumerate(zip(remote, self.layers)):
            for name in ("num_prefixes", "chunk_bytes", "dtype", "group", "memory"):
                if getattr(theirs, name) != getattr(ours, name):
                    raise ValueError(
                        f"kv_transfer_params: cache layer {i}'s {name} is "
                        f"{getattr(theirs, name)!r} on the prefill instance, "
                        f"{getattr(ours, name)!r} here (same model, kv_cache_dtype and "
                        f"tensor_parallel_size needed)"
                    )


@dataclass(frozen=True)
class RemoteLoad:
    """One request's read: its ``local`` blocks (per cache group) from the ``remote`` ones of
    the prefill instance ``engine_id``; its notification names ``remote_request_id``."""

    request_id: str
    engine_id: str
    agent_metadata: str
    remote_request_id: str
    local: list[list[int]]
    remote: list[list[int]]
    remote_layers: list[list[Any]]


@dataclass(frozen=True)
class NixlMeta(KVConnectorMeta):
    loads: list[RemoteLoad] = field(default_factory=list)


class NixlScheduler(KVConnectorScheduler):
    """The ``prefill`` side holds finished requests' blocks (until read or timed out); the
    ``decode`` side turns a request's ``kv_transfer_params`` into a load of its prompt.
    ``state_groups``: the cache groups of one entry per request (recurrent states), read
    whole: the prefill side's entry keeping the state after all but the prompt's last token."""

    loads_outlive_steps = True  # (a READ runs on in UCX's threads)

    def __init__(
        self,
        role: str,
        agent: NixlAgent,
        block_size: int,
        hold_timeout_s: float,
        state_groups: frozenset[int] = frozenset(),
        on_read_failure: str = "recompute",
    ) -> None:
        self.role = role
        self.agent = agent
        self.block_size = block_size
        self.state_groups = state_groups
        self.on_read_failure = on_read_failure
        self.hold_timeout_s = hold_timeout_s
        self._held: dict[str, tuple[float, int]] = {}  # request -> (deadline, blocks)
        self._in_flight = InFlightLoads()
        self._meta = NixlMeta()
        self.failed_loads = 0
        self.hold_timeouts = 0

    # ------------------------------------------------------------------ both sides

    def check_params(self, params: dict, num_prompt_tokens: int) -> None:
        if self.role == "prefill":
            if params.get("do_remote_decode") is not True:
                raise ValueError(
                    "kv_transfer_params: a prefill instance serves "
                    '{"do_remote_decode": true} (its blocks are kept for a decode instance)'
                )
            return
        missing = [name for name in _DECODE_PARAMS if params.get(name) is None]
        if missing or params["do_remote_prefill"] is not True:
            raise ValueError(
                "kv_transfer_params: a decode instance needs a prefill instance's answer's "
                f"kv_transfer_params (missing: {', '.join(missing) or 'do_remote_prefill=true'})"
            )
        if params["remote_num_tokens"] != num_prompt_tokens:
            raise ValueError(
                f"kv_transfer_params: the prefill instance computed "
                f"{params['remote_num_tokens']} prompt tokens, this prompt has "
                f"{num_prompt_tokens} (send both the same prompt)"
            )
        self.agent.check_compatible(self.block_size, params)
        for g in sorted(self.state_groups):
            if num_prompt_tokens > 1 and len(params["remote_block_ids"][g]) != 1:
                raise ValueError(
                    f"kv_transfer_params: remote_block_ids names no recurrent state entry of "
                    f"cache group {g} (a prefill instance's answer keeps one)"
                )

    def describe(self) -> str:
        return f"NIXL prefill/decode disaggregation ({self.role}, engine {self.agent.engine_id})"

    # ------------------------------------------------------------------ prefill

    def hold(self, request: CachedSequence, tables: Sequence[Sequence[int]]) -> bool:
        params = request.sampling_params.kv_transfer_params
        if self.role != "prefill" or not params or request.sample_index:
            return False
        num_blocks = sum(1 for table in tables for b in table if b != NULL_BLOCK_ID)
        self._held[request.request_id] = (time.monotonic() + self.hold_timeout_s, num_blocks)
        request.kv_transfer_params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.agent.engine_id,
            "remote_agent_metadata": self.agent.metadata,
            "remote_layers": [list(layer) for layer in self.agent.layers],
            "remote_block_size": self.block_size,
            "remote_block_ids": [list(table) for table in tables],
            "remote_request_id": request.request_id,
            "remote_num_tokens": request.num_prompt_tokens,
        }
        return True

    def released(self) -> list[str]:
        held = self._held
        done = [r for r in self.agent.notifications() if held.pop(r, None) is not None]
        now = time.monotonic()
        expired = [r for r, (deadline, _) in held.items() if deadline <= now]
        for request_id in expired:
            logger.warning(
                "request %s: no decode instance read its blocks within %g s; freed",
                request_id,
                self.hold_timeout_s,
            )
            del held[request_id]
        self.hold_timeouts += len(expired)
        return done + expired

    # ------------------------------------------------------------------ decode

    def lookup(self, request: CachedSequence, num_device_tokens: int) -> ExternalHits:
        params = request.sampling_params.kv_transfer_params
        if self.role != "decode" or not params:
            return ExternalHits(0)
        hit = self._chain(request)[: num_device_tokens // self.block_size]
        if self._in_flight and any(h in self._in_flight for h in hit):
            return ExternalHits(0, wait=True)  # a device hit on blocks still being read
        if request.sample_index or request.first_scheduled_time is not None:
            # Samples after the first hit its blocks; a request scheduled before (its read
            # failed, or it was preempted since) computes its prompt: the blocks may be gone.
            return ExternalHits(0)
        num_tokens = request.num_prompt_tokens - 1 - num_device_tokens
        if num_tokens <= 0:  # the device holds the prompt: the prefill side may free it
            self.agent.release_remote(params)
        return ExternalHits(max(0, num_tokens))

    def _chain(self, request: CachedSequence) -> list[int]:
        """The chain hashes of the prompt's full blocks (before its last token)."""
        bs, tokens, parent = self.block_size, request.prompt_token_ids, request.prefix_root
        hashes = []
        for i in range((len(tokens) - 1) // bs):
            parent = hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs])
            hashes.append(parent)
        return hashes

    def load(
        self,
        request: CachedSequence,
        tables: Sequence[Sequence[int]],
        num_device_tokens: int,
        num_tokens: int,
    ) -> None:
        params = request.sampling_params.kv_transfer_params
        bs = self.block_size
        first, end = num_device_tokens // bs, -(-(num_device_tokens + num_tokens) // bs)
        self._meta.loads.append(
            RemoteLoad(
                request.request_id,
                params["remote_engine_id"],
                params["remote_agent_metadata"],
                params["remote_request_id"],
                self._loaded(tables, first, end),
                self._loaded(params["remote_block_ids"], first, end),
                params["remote_layers"],
            )
        )
        self._meta.load_requests.append(request.request_id)
        loading = self._chain(request)[first:end]
        self._in_flight.start(request.request_id, loading)

    def _loaded(self, tables: Sequence[Sequence[int]], first: int, end: int) -> list[list[int]]:
        """Per group, the entries a load reads: blocks ``first:end``, a state group's entry."""
        return [
            list(table if g in self.state_groups else table[first:end])
            for g, table in enumerate(tables)
        ]

    def scheduled(
        self, request: CachedSequence, tables: Sequence[Sequence[int]], hashes: Sequence[int]
    ) -> None:
        pass

    def freed(
        self, request: CachedSequence, tables: Sequence[Sequence[int]], hashes: Sequence[int]
    ) -> None:
        params = request.sampling_params.kv_transfer_params
        if (
            self.role == "decode"
            and params
            and not request.sample_index
            and request.first_scheduled_time is None
        ):  # aborted before its read started: the prefill side may free the blocks now
            self.agent.release_remote(params)

    def forget(self, request_id: str) -> None:
        self._in_flight.end(request_id)

    def finished(self, results: TransferResults) -> None:
        for request_id in results.failed_loads:
            self.failed_loads += 1
            self._in_flight.end(request_id)
        for request_id in results.loaded:
            self._in_flight.end(request_id)

    def failed_load_error(self, request_id: str) -> str | None:
        if self.on_read_failure == "recompute":
            return None
        return (
            f"request {request_id}: the KV read from the prefill instance failed or timed out "
            "(kv_connector_extra_config on_read_failure='abort')"
        )

    def take_step_meta(self) -> NixlMeta | None:
        meta = self._meta
        if not meta.load_requests:
            return None
        self._meta = NixlMeta()
        return meta

    def metrics(self) -> list[ConnectorMetric]:
        stats = self.agent.stats
        return [
            ConnectorMetric(
                "kv_transfer_blocks", "blocks read from prefill instances", stats.blocks, True
            ),
            ConnectorMetric(
                "kv_transfer_bytes", "bytes read from prefill instances", stats.bytes, True
            ),
            ConnectorMetric(
                "kv_transfer_seconds",
                "seconds from a read's start to its end, over all requests",
                stats.seconds,
                True,
            ),
            ConnectorMetric(
                "kv_transfer_failed_loads",
                "requests whose read failed or timed out (recomputed, or failed)",
                self.failed_loads,
                True,
            ),
            ConnectorMetric(
                "kv_transfer_held_blocks",
                "blocks of finished requests kept for a decode instance to read",
                sum(n for _, n in self._held.values()),
                False,
            ),
            ConnectorMetric(
                "kv_transfer_hold_timeouts",
                "finished requests whose blocks no decode instance read in time (freed)",
                self.hold_timeouts,
                True,
            ),
        ]

    def check_invariants(self) -> None:
        self._in_flight.check_invariants("nixl")


class _Read(NamedTuple):
    request_id: str
    handle: Any
    start: float
    num_blocks: int
    num_bytes: int


class NixlWorker(KVConnectorWorker):
    """Registers the caches with the agent; starts each load's READ before the step and
    reports it once done (or failed, or past ``transfer_timeout_s``)."""

    def __init__(self, agent: NixlAgent, transfer_timeout_s: float) -> None:
        self.agent = agent
        self.transfer_timeout_s = transfer_timeout_s
        self._reads: list[_Read] = []
        self._results = TransferResults()

    def register_caches(self, layout: CacheLayout, layer_steps: LayerSteps) -> None:
        self.agent.register(layout)

    def start_step(self, meta: NixlMeta) -> None:
        for load in meta.loads:
            try:
                self._reads.append(self._read(load))
            except Exception:
                logger.exception("request %s: the KV read could not start", load.request_id)
                self._results.failed_loads.append(load.request_id)

    def _read(self, load: RemoteLoad) -> _Read:
        agent = self.agent
        remote_layers = [LayerRegion(*layer) for layer in load.remote_layers]
        local, remote = [], []
        for ours, theirs in zip(agent.layers, remote_layers):
            g = ours.group
            for lb, rb in zip(load.local[g], load.remote[g]):
                if NULL_BLOCK_ID not in (lb, rb):
                    local += ours.chunks(lb)
                    remote += theirs.chunks(rb)
        name = agent.remote(load.engine_id, load.agent_metadata)
        memory = agent.layers[0].memory
        handle = agent.agent.initialize_xfer(
            "READ",
            agent.agent.get_xfer_descs(local, memory),
            agent.agent.get_xfer_descs(remote, memory),
            name,
            load.remote_request_id.encode(),
        )
        if agent.agent.transfer(handle) == "ERR":
            agent.agent.release_xfer_handle(handle)
            raise KVTransferError(f"request {load.request_id}: the KV read failed to start")
        num_blocks = sum(1 for g in load.local for b in g if b != NULL_BLOCK_ID)
        return _Read(
            load.request_id, handle, time.monotonic(), num_blocks, sum(d[1] for d in local)
        )

    def end_step(self, meta: NixlMeta) -> None:
        pass

    def take_results(self) -> TransferResults:
        now, pending = time.monotonic(), []
        for read in self._reads:
            try:
                state = self.agent.agent.check_xfer_state(read.handle)
            except Exception:
                logger.exception("request %s: the KV read failed", read.request_id)
                state = "ERR"
            if state == "PROC" and now - read.start < self.transfer_timeout_s:
                pending.append(read)
                continue
            self._release(read.handle)
            if state == "DONE":
                stats = self.agent.stats
                stats.blocks += read.num_blocks
                stats.bytes += read.num_bytes
                stats.seconds += now - read.start
                self._results.loaded.append(read.request_id)
            else:
                logger.warning(
                    "request %s: the KV read %s; its prompt is recomputed",
                    read.request_id,
                    "timed out" if state == "PROC" else "failed",
                )
                self._results.failed_loads.append(read.request_id)
        self._reads = pending
        results, self._results = self._results, TransferResults()
        return results

    def _release(self, handle: Any) -> None:
        try:
            self.agent.agent.release_xfer_handle(handle)
        except Exception:
            logger.exception("a KV read's handle could not be released")

    def shutdown(self) -> None:
        for read in self._reads:
            self._release(read.handle)
        self._reads = []
