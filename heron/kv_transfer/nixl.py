"""Prefill/decode disaggregation over NIXL: the ``nixl`` connector.

A ``prefill`` instance computes a request's prompt (and first token) for a ``decode``
instance, which computes the prompt's last token itself and decodes. The KV moves one of two
ways (``kv_transfer_mode``, :data:`TRANSFER_MODES`):

``layerwise``: the router sends the request to both instances at once with one
``transfer_id``. The decode instance allocates blocks for the prompt and sends their ids to
the prefill instance (a NIXL notification; it met the prefill instance's agent through the
router, which read it from ``GET /kv_transfer``); the prefill request waits for them (never
holding up others), then each of its prefill steps WRITEs each layer's blocks as soon as the
layer is computed (:mod:`heron.kv_transfer.nixl_push`), and the last chunk's writes end with
a notification that the transfer is complete.

``whole`` (any model; what recurrent states need): the prefill instance keeps a finished
request's blocks (``kv_transfer_params: {"do_remote_decode": true}``) and its answer's
``kv_transfer_params`` say where they are: the instance's NIXL agent metadata, its cache
layout (one memory region per cache layer) and the request's block ids. The decode instance
reads them with one NIXL READ whose notification tells the prefill side to free them. A model
with recurrent layers also reads each layer's state (conv and recurrent) after all but the
prompt's last token, which the prefill side keeps in an entry of its own
(``Request.keep_state_at``).

The prefill side frees blocks nobody read after ``hold_timeout_s``, and fails a layerwise
request whose destination did not come within it; a transfer that fails or outlasts
``transfer_timeout_s`` is recomputed on the decode side (the client gets the right answer,
later) or, with ``on_read_failure: "abort"``, fails the request (the client gets the error at
once). A layerwise transfer that outlasts it is cancelled first: its blocks are freed once the
prefill side confirms no write is left (or after a second ``transfer_timeout_s``).

Both halves live in the engine process and share one :class:`NixlAgent` (the scheduler side
reads its notifications) and, on a layerwise prefill instance, one :class:`Pusher`: tensor
parallelism is refused for every connector.
"""

from __future__ import annotations

import logging
import time
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
from heron.kv_transfer.nixl_agent import LayerRegion, NixlAgent, descriptors
from heron.kv_transfer.nixl_push import Binding, Destination, LayerwiseSave, Pusher

if TYPE_CHECKING:
    from heron.cache.layout import CacheLayout
    from heron.cache.manager import CachedSequence
    from heron.kv_transfer.layer_steps import LayerSteps

logger = logging.getLogger(__name__)

# What a decode instance does with a request whose read failed or timed out: compute its
# prompt itself (the right answer, later), or fail it (the client gets the error at once).
READ_FAILURES = ("recompute", "abort")

# How the KV moves (see the module's doc).
TRANSFER_MODES = ("layerwise", "whole")

# What a decode instance's layerwise request carries: the router's transfer id and the
# prefill instance's handshake (its ``GET /kv_transfer``).
_LAYERWISE_PARAMS = (
    "do_remote_prefill",
    "transfer_id",
    "remote_engine_id",
    "remote_agent_metadata",
    "remote_layers",
    "remote_block_size",
)

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
class RemoteWrite:
    """One request's layerwise transfer, from the decode side: its ``destination`` goes to
    the prefill instance ``engine_id``, whose ``written`` message ends it."""

    request_id: str
    engine_id: str
    agent_metadata: str
    destination: Destination


@dataclass(frozen=True)
class NixlMeta(KVConnectorMeta):
    loads: list[RemoteLoad] = field(default_factory=list)
    writes: list[RemoteWrite] = field(default_factory=list)  # (decode: awaited)
    saves: list[LayerwiseSave] = field(default_factory=list)  # (prefill: written)


class NixlScheduler(KVConnectorScheduler):
    """The ``prefill`` side holds finished requests' blocks (until read or timed out), or has
    ``pusher`` write a layerwise request's blocks to its destination; the ``decode`` side
    turns a request's ``kv_transfer_params`` into a load of its prompt (a READ, or a wait for
    the writes). ``state_groups``: the cache groups of one entry per request (recurrent
    states), read whole: the prefill side's entry keeping the state after all but the prompt's
    last token."""

    loads_outlive_steps = True  # (a READ runs on in UCX's threads)

    def __init__(
        self,
        role: str,
        agent: NixlAgent,
        block_size: int,
        hold_timeout_s: float,
        state_groups: frozenset[int] = frozenset(),
        on_read_failure: str = "recompute",
        mode: str = "whole",
        pusher: Pusher | None = None,
    ) -> None:
        self.role = role
        self.mode = mode
        self.pusher = pusher
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
        # prefill: layerwise requests waiting for their destination (since), and bound to it
        self._waiting_since: dict[str, float] = {}
        self._bound: dict[str, Binding] = {}
        self._cancelled: dict[str, float] = {}  # transfer ids given up before they were bound

    # ------------------------------------------------------------------ both sides

    def check_params(self, params: dict, num_prompt_tokens: int) -> None:
        if self.role == "prefill":
            if params.get("do_remote_decode") is not True:
                raise ValueError(
                    "kv_transfer_params: a prefill instance serves "
                    '{"do_remote_decode": true} (its blocks are kept for a decode instance)'
                )
            if "transfer_id" in params:
                self._check_layerwise(params)
            return
        if "transfer_id" in params:
            self._check_layerwise(params)
            missing = [name for name in _LAYERWISE_PARAMS if params.get(name) is None]
            if missing or params["do_remote_prefill"] is not True:
                raise ValueError(
                    "kv_transfer_params: a layerwise transfer needs the prefill instance's "
                    "GET /kv_transfer answer and do_remote_prefill=true (missing: "
                    f"{', '.join(missing) or 'do_remote_prefill=true'})"
                )
            self.agent.check_compatible(self.block_size, params)
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

    def _check_layerwise(self, params: dict) -> None:
        if self.mode != "layerwise":
            raise ValueError(
                "kv_transfer_params: transfer_id asks for a layerwise transfer; this "
                "instance's kv_connector_extra_config kv_transfer_mode is 'whole'"
            )
        if not isinstance(params["transfer_id"], str) or not params["transfer_id"]:
            raise ValueError("kv_transfer_params: transfer_id must be a non-empty string")

    def describe(self) -> str:
        return (
            f"NIXL prefill/decode disaggregation ({self.role}, {self.mode}, "
            f"engine {self.agent.engine_id})"
        )

    def handshake(self) -> dict:
        return {
            "kv_transfer_mode": self.mode,
            "remote_engine_id": self.agent.engine_id,
            "remote_agent_metadata": self.agent.metadata,
            "remote_layers": [list(layer) for layer in self.agent.layers],
            "remote_block_size": self.block_size,
        }

    # ------------------------------------------------------------------ prefill

    def hold(self, request: CachedSequence, tables: Sequence[Sequence[int]], aborted: bool) -> bool:
        params = request.sampling_params.kv_transfer_params
        if self.role != "prefill" or not params:
            return False
        request_id = request.request_id
        num_blocks = sum(1 for table in tables for b in table if b != NULL_BLOCK_ID)
        self._waiting_since.pop(request_id, None)
        binding = self._bound.pop(request_id, None)
        if binding is not None:  # (held until the pusher's writes from them ended)
            self.pusher.close(request_id, binding.destination)
            self._held[request_id] = (float("inf"), num_blocks)
            request.kv_transfer_params = {"transfer_id": binding.destination.transfer_id}
            return True
        if request.sample_index or aborted:
            return False
        self._held[request_id] = (time.monotonic() + self.hold_timeout_s, num_blocks)
        request.kv_transfer_params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            **{k: v for k, v in self.handshake().items() if k != "kv_transfer_mode"},
            "remote_block_ids": [list(table) for table in tables],
            "remote_request_id": request_id,
            "remote_num_tokens": request.num_prompt_tokens,
        }
        return True

    def _destination(self, request: CachedSequence, transfer_id: str) -> ExternalHits:
        """A layerwise request runs once its destination came, or fails past the timeout."""
        request_id = request.request_id
        self._poll()
        if self._cancelled.pop(transfer_id, None) is not None:
            return ExternalHits(
                0,
                error=f"request {request_id}: the decode instance gave transfer "
                f"{transfer_id!r} up (it waited past its transfer_timeout_s)",
            )
        arrived = self.agent.destinations.pop(transfer_id, None)
        if arrived is not None:
            self._waiting_since.pop(request_id, None)
            self._bound[request_id] = Binding(Destination.of(arrived[1]))
            return ExternalHits(0)
        since = self._waiting_since.setdefault(request_id, time.monotonic())
        if time.monotonic() - since <= self.hold_timeout_s:
            return ExternalHits(0, wait=True)
        self.hold_timeouts += 1
        return ExternalHits(
            0,
            error=f"request {request_id}: no decode instance sent where its KV goes "
            f"(transfer_id {transfer_id!r}) within {self.hold_timeout_s:g} s "
            "(kv_connector_extra_config hold_timeout_s)",
        )

    def _poll(self) -> None:
        """Read the notifications; a decode side's cancel stops its transfer's writes (or,
        before the request was bound, is answered at once)."""
        agent = self.agent
        agent.poll()
        now = time.monotonic()
        if self._cancelled:  # (their request never came)
            stale = [t for t, since in self._cancelled.items() if now - since > agent.stale_s]
            for transfer_id in stale:
                del self._cancelled[transfer_id]
        if not agent.cancels or self.pusher is None:  # (a whole-mode instance writes nothing)
            agent.cancels.clear()
            return
        by_transfer = {b.destination.transfer_id: r for r, b in self._bound.items()}
        for transfer_id in agent.cancels:
            request_id = by_transfer.get(transfer_id)
            if request_id is not None:
                self._bound[request_id].done = True  # (no more saves)
                self.pusher.cancel(request_id, self._bound[request_id].destination)
                continue
            self._cancelled[transfer_id] = now
            if (arrived := agent.destinations.pop(transfer_id, None)) is not None:
                self.pusher.cancel(None, Destination.of(arrived[1]))
        agent.cancels.clear()

    def released(self) -> list[str]:
        held = self._held
        self._poll()
        done = [r for r in self.agent.read if held.pop(r, None) is not None]
        self.agent.read.clear()
        while self.pusher is not None and self.pusher.ended:
            request_id = self.pusher.ended.popleft()
            if held.pop(request_id, None) is not None:
                done.append(request_id)
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
        if not params:
            return ExternalHits(0)
        if self.role == "prefill":
            transfer_id = params.get("transfer_id")
            if transfer_id is None or request.sample_index or request.request_id in self._bound:
                return ExternalHits(0)
            return self._destination(request, transfer_id)
        hit = self._chain(request)[: num_device_tokens // self.block_size]
        if self._in_flight and any(h in self._in_flight for h in hit):
            return ExternalHits(0, wait=True)  # a device hit on blocks still being read
        if request.sample_index or request.first_scheduled_time is not None:
            # Samples after the first hit its blocks; a request scheduled before (its read
            # failed, or it was preempted since) computes its prompt: the blocks may be gone.
            return ExternalHits(0)
        num_tokens = request.num_prompt_tokens - 1 - num_device_tokens
        if num_tokens <= 0:  # the device holds the prompt: the prefill side may free it
            self._release(params)
        return ExternalHits(max(0, num_tokens))

    def _release(self, params: dict) -> None:
        """Tell the prefill instance that nothing of the prompt will be read (or written)."""
        if "transfer_id" not in params:
            self.agent.release_remote(params)
            return
        num_groups = 1 + max(layer.group for layer in self.agent.layers)
        destination = self._destination_of(params["transfer_id"], 0, [[]] * num_groups)
        try:
            self.agent.send(
                params["remote_engine_id"],
                params["remote_agent_metadata"],
                destination.message(),
            )
        except Exception:
            logger.exception(
                "transfer %s: the prefill instance was not told", params["transfer_id"]
            )

    def _destination_of(
        self, transfer_id: str, first_block: int, block_ids: list[list[int]]
    ) -> Destination:
        agent = self.agent
        layers = [list(layer) for layer in agent.layers]
        return Destination(
            transfer_id, agent.engine_id, agent.metadata, layers, first_block, block_ids
        )

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
        if "transfer_id" in params:
            destination = self._destination_of(
                params["transfer_id"], first, self._loaded(tables, first, end)
            )
            self._meta.writes.append(
                RemoteWrite(
                    request.request_id,
                    params["remote_engine_id"],
                    params["remote_agent_metadata"],
                    destination,
                )
            )
        else:
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
        self,
        request: CachedSequence,
        tables: Sequence[Sequence[int]],
        hashes: Sequence[int],
        num_new: int,
    ) -> None:
        binding = self._bound.get(request.request_id)
        if binding is None:
            return
        save = binding.save(
            request.request_id,
            tables,
            request.num_computed_tokens,
            num_new,
            request.num_prompt_tokens,
            self.block_size,
        )
        if save is not None:
            self._meta.saves.append(save)

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
            self._release(params)

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
        if self.pusher is not None:
            self._poll()
        if not meta.load_requests and not meta.saves:
            return None
        self._meta = NixlMeta()
        return meta

    def metrics(self) -> list[ConnectorMetric]:
        stats = self.agent.stats
        return [
            ConnectorMetric(
                "kv_transfer_blocks",
                "blocks read or received from prefill instances, or written to decode instances",
                stats.blocks,
                True,
            ),
            ConnectorMetric(
                "kv_transfer_bytes",
                "bytes read or received from prefill instances, or written to decode instances",
                stats.bytes,
                True,
            ),
            ConnectorMetric(
                "kv_transfer_seconds",
                "seconds from a transfer's start to its end, over all requests",
                stats.seconds,
                True,
            ),
            ConnectorMetric(
                "kv_transfer_failed_loads",
                "requests whose transfer failed or timed out (recomputed, or failed)",
                self.failed_loads,
                True,
            ),
            ConnectorMetric(
                "kv_transfer_held_blocks",
                "blocks of finished requests kept for a decode instance to read, or until "
                "their writes ended",
                sum(n for _, n in self._held.values()),
                False,
            ),
            ConnectorMetric(
                "kv_transfer_hold_timeouts",
                "requests whose blocks no decode instance read in time (freed), or whose "
                "destination no decode instance sent in time (failed)",
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


@dataclass
class _AwaitedWrite:
    """A layerwise transfer the decode side waits for: since ``start``, and since the prefill
    side last reported progress (``alive``); ``cancelled``: when it gave up."""

    write: RemoteWrite
    start: float
    num_blocks: int
    num_bytes: int
    cancelled: float | None = None

    def __post_init__(self) -> None:
        self.alive = self.start


class NixlWorker(KVConnectorWorker):
    """Registers the caches with the agent; starts each load's READ before the step and
    reports it once done (or failed, or past ``transfer_timeout_s``); on the decode side of a
    layerwise transfer, sends its destination and reports it once the prefill side says
    how it ended. With a ``pusher`` (a layerwise prefill instance) it hands each step's saves
    to it."""

    def __init__(
        self, agent: NixlAgent, transfer_timeout_s: float, pusher: Pusher | None = None
    ) -> None:
        self.agent = agent
        self.transfer_timeout_s = transfer_timeout_s
        self.pusher = pusher
        self.layerwise = pusher is not None
        self._reads: list[_Read] = []
        self._awaited: list[_AwaitedWrite] = []
        self._results = TransferResults()

    def register_caches(self, layout: CacheLayout, layer_steps: LayerSteps) -> None:
        self.agent.register(layout)
        if self.pusher is not None:
            self.pusher.start(layer_steps)

    def start_step(self, meta: NixlMeta) -> None:
        if meta.saves:
            self.pusher.submit(meta.saves)
        for load in meta.loads:
            try:
                self._reads.append(self._read(load))
            except Exception:
                logger.exception("request %s: the KV read could not start", load.request_id)
                self._results.failed_loads.append(load.request_id)
        for write in meta.writes:
            try:
                self.agent.send(write.engine_id, write.agent_metadata, write.destination.message())
            except Exception:
                logger.exception("request %s: the prefill instance was not told", write.request_id)
                self._results.failed_loads.append(write.request_id)
                continue
            self._awaited.append(_AwaitedWrite(write, time.monotonic(), *self._size(write)))

    def _size(self, write: RemoteWrite) -> tuple[int, int]:
        """The blocks and bytes the transfer writes here."""
        block_ids = write.destination.block_ids
        num_blocks = sum(1 for ids in block_ids for b in ids if b != NULL_BLOCK_ID)
        num_bytes = sum(
            layer.num_prefixes * layer.chunk_bytes
            for layer in self.agent.layers
            for b in block_ids[layer.group]
            if b != NULL_BLOCK_ID
        )
        return num_blocks, num_bytes

    def _read(self, load: RemoteLoad) -> _Read:
        agent = self.agent
        remote_layers = [LayerRegion(*layer) for layer in load.remote_layers]
        local, remote = [], []
        for ours, theirs in zip(agent.layers, remote_layers):
            pairs = zip(load.local[ours.group], load.remote[ours.group])
            here, there = descriptors(ours, theirs, (p for p in pairs if NULL_BLOCK_ID not in p))
            local += here
            remote += there
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
            how = "timed out" if state == "PROC" else "failed"
            self._ended(
                read.request_id, state == "DONE", how, read.start, read.num_blocks, read.num_bytes
            )
        self._reads = pending
        if self._awaited:
            self._take_written(now)
        results, self._results = self._results, TransferResults()
        return results

    def _take_written(self, now: float) -> None:
        """End the layerwise transfers the prefill side says ended; cancel those that made
        no progress within the timeout (their blocks are kept until it confirms, or a second
        timeout passed)."""
        self.agent.poll()
        pending = []
        for awaited in self._awaited:
            write = awaited.write
            transfer_id = write.destination.transfer_id
            written = self.agent.written.pop(transfer_id, None)
            awaited.alive = max(awaited.alive, self.agent.progress.pop(transfer_id, 0.0))
            if written is None and awaited.cancelled is None:
                if now - awaited.alive < self.transfer_timeout_s:
                    pending.append(awaited)
                    continue
                logger.warning("transfer %s: the prefill instance is late; cancelled", transfer_id)
                awaited.cancelled = now
                try:
                    message = {"kind": "cancel", "transfer_id": transfer_id}
                    self.agent.send(write.engine_id, write.agent_metadata, message)
                except Exception:
                    logger.exception("transfer %s: the prefill instance was not told", transfer_id)
            if written is None and now - awaited.cancelled < self.transfer_timeout_s:
                pending.append(awaited)
                continue
            complete = written is not None and written[1] and awaited.cancelled is None
            how = "timed out" if awaited.cancelled is not None else "was not completed"
            self._ended(
                write.request_id,
                complete,
                how,
                awaited.start,
                awaited.num_blocks,
                awaited.num_bytes,
            )
        self._awaited = pending

    def _ended(
        self, request_id: str, done: bool, how: str, start: float, num_blocks: int, num_bytes: int
    ) -> None:
        """A transfer to this instance ended: its request's load is done (counted), or failed."""
        if done:
            stats = self.agent.stats
            stats.blocks += num_blocks
            stats.bytes += num_bytes
            stats.seconds += time.monotonic() - start
            self._results.loaded.append(request_id)
        else:
            logger.warning(
                "request %s: the KV transfer %s; its prompt is recomputed", request_id, how
            )
            self._results.failed_loads.append(request_id)

    def _release(self, handle: Any) -> None:
        try:
            self.agent.agent.release_xfer_handle(handle)
        except Exception:
            logger.exception("a KV read's handle could not be released")

    def shutdown(self) -> None:
        for read in self._reads:
            self._release(read.handle)
        self._reads = []
        if self.pusher is not None:
            self.pusher.shutdown()
        self.agent.close()
