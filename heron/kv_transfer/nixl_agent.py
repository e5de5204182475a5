"""A NIXL agent of the ``nixl`` connector: its registered cache regions, the remote agents it
met, and the notifications both instances send each other.

A bare notification names a request whose held blocks a decode instance has read (or will not
read). The layerwise flow's messages are JSON behind :data:`_MESSAGE`: a decode instance's
``destination`` (where a transfer's blocks go), a prefill instance's ``progress`` (a step
wrote some) and ``written`` (the transfer ended: complete, or not); a decode instance that gave
up a transfer sends ``cancel``."""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from heron.cache.layout import CacheLayout

logger = logging.getLogger(__name__)

_MESSAGE = "heron-kv:"  # (request ids never start so: the front makes them)


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

    def span(self, prefix: int, block: int, count: int) -> tuple[int, int, int]:
        """The (address, length, device) descriptor of ``count`` blocks from ``block`` in run
        ``prefix``."""
        start = self.address + (prefix * self.num_blocks + block) * self.chunk_bytes
        return start, count * self.chunk_bytes, self.device_id


def descriptors(
    ours: LayerRegion, theirs: LayerRegion, pairs: Iterable[tuple[int, int]]
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """The local and remote descriptors moving blocks ``pairs`` (local id, remote id) of one
    cache tensor: blocks consecutive on both sides join one descriptor (UCX pays per
    descriptor, and a prompt's blocks are mostly allocated in order)."""
    runs: list[list[int]] = []  # [local first, remote first, count]
    for local, remote in pairs:
        if runs and runs[-1][0] + runs[-1][2] == local and runs[-1][1] + runs[-1][2] == remote:
            runs[-1][2] += 1
        else:
            runs.append([local, remote, 1])
    spans = [(p, run) for p in range(ours.num_prefixes) for run in runs]
    return (
        [ours.span(p, local, n) for p, (local, _, n) in spans],
        [theirs.span(p, remote, n) for p, (_, remote, n) in spans],
    )


@dataclass
class TransferStats:
    """What moved (read by a decode instance, or written by a prefill instance; the worker
    counts, the scheduler side reports)."""

    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0


class NixlAgent:
    """This instance's NIXL agent: its registered caches, the remote agents it met, and what
    the notifications it received say (sorted by :meth:`poll`). A layerwise saver's thread
    uses it beside the engine's: its calls are serialised (NIXL's strict thread mode).
    ``stale_s``: how long a message nobody claimed is kept."""

    def __init__(self, stale_s: float = 600.0) -> None:
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

        self.engine_id = uuid.uuid4().hex
        strict = nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
        self.agent = nixl_agent(
            self.engine_id, nixl_agent_config(backends=["UCX"], sync_mode=strict)
        )
        self.layers: list[LayerRegion] = []
        self.stats = TransferStats()
        self.stale_s = stale_s
        self.read: list[str] = []  # requests whose held blocks were read (or are not wanted)
        self.destinations: dict[str, tuple[float, dict]] = {}  # transfer id: (arrival, message)
        self.written: dict[str, tuple[float, bool]] = {}  # transfer id: (arrival, complete)
        self.cancels: list[str] = []  # transfer ids a decode instance gave up
        self.progress: dict[str, float] = {}  # transfer id: when a prefill step wrote some
        self._registered: list[Any] = []
        self._remotes: dict[str, str] = {}
        self._lock = threading.Lock()  # (remotes are met from the saver's thread too)

    def register(self, layout: CacheLayout) -> None:
        self._deregister()
        self.layers, seen = [], set()
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

    def close(self) -> None:
        """Deregister the caches and end the agent: its UCX progress thread polls a core for
        as long as it lives."""
        self._deregister()
        self.agent = None

    def _deregister(self) -> None:
        for handle in self._registered:
            self.agent.deregister_memory(handle)
        self._registered = []

    @property
    def metadata(self) -> str:
        return base64.b64encode(self.agent.get_agent_metadata()).decode()

    def remote(self, engine_id: str, metadata: str) -> str:
        """The name of the remote agent ``engine_id`` (met once, then remembered)."""
        with self._lock:
            name = self._remotes.get(engine_id)
            if name is None:
                name = self.agent.add_remote_agent(base64.b64decode(metadata))
                name = name.decode() if isinstance(name, bytes) else name
                self._remotes[engine_id] = name
            return name

    def send(self, engine_id: str, metadata: str, message: dict) -> None:
        """One of the layerwise flow's messages to the agent ``engine_id``."""
        text = _MESSAGE + json.dumps(message)
        self.agent.send_notif(self.remote(engine_id, metadata), text.encode())

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

    def poll(self) -> None:
        """Sort the notifications received since the last call; drop messages kept past
        ``stale_s`` (their request gave up)."""
        now = time.monotonic()
        for message in (m.decode() for ms in self.agent.get_new_notifs().values() for m in ms):
            if not message.startswith(_MESSAGE):
                self.read.append(message)
                continue
            body = json.loads(message.removeprefix(_MESSAGE))
            if body["kind"] == "destination":
                self.destinations[body["transfer_id"]] = (now, body)
            elif body["kind"] == "cancel":
                self.cancels.append(body["transfer_id"])
            elif body["kind"] == "progress":
                self.progress[body["transfer_id"]] = now
            else:
                self.written[body["transfer_id"]] = (now, body["complete"])
        for kept in (self.destinations, self.written):
            for transfer_id in [
                t for t, (arrival, _) in kept.items() if now - arrival > self.stale_s
            ]:
                del kept[transfer_id]
        for transfer_id in [t for t, at in self.progress.items() if now - at > self.stale_s]:
            del self.progress[transfer_id]

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
