"""The KV connector interface: the cache's way out of the engine, split as vLLM v1's is.

The *scheduler side* answers how many of a request's next tokens an outside store holds
(past what the device pool holds), is told which freshly allocated blocks those tokens go
into and which blocks each step computes, and turns that into the step's transfer metadata:
plain data the step plan carries to the runner. The *worker side* holds the cache tensors of
every cache group, carries a step's loads out before its forward pass and its saves after it
(or layer by layer, on the runner's :class:`~heron.kv_transfer.layer_steps.LayerSteps`), and
reports which loads ended and which failed. A failed load is recomputed, never half-used.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from heron.cache.layout import CacheLayout
    from heron.cache.manager import CachedSequence, StateCopies
    from heron.cache.spec import CacheSpec
    from heron.kv_transfer.layer_steps import LayerSteps


class KVTransferError(RuntimeError):
    """A transfer failed (a load's tokens are recomputed; a save's entries are dropped)."""


class ExternalHits(NamedTuple):
    """A lookup's answer: ``num_tokens`` past the device pool's hit that the store can load,
    or ``wait``: the request waits a step (blocks it would hit are still being loaded for
    another request, or a transfer's other end has not answered yet), or ``error``: the
    request cannot run, and fails with it."""

    num_tokens: int
    wait: bool = False
    error: str | None = None


class InFlightLoads:
    """The block hashes each loading request loads, counted over the requests: a device-pool
    hit on a block still being loaded waits for the load. A load not ended within
    ``timeout_s`` is given up (:meth:`expired`)."""

    def __init__(self, timeout_s: float = float("inf")) -> None:
        self.timeout_s = timeout_s
        self._by_request: dict[str, list[int]] = {}
        self._started: dict[str, float] = {}
        self._count: Counter[int] = Counter()

    def __bool__(self) -> bool:
        return bool(self._count)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._count

    def start(self, request_id: str, hashes: list[int]) -> None:
        self._by_request[request_id] = hashes
        self._started[request_id] = time.monotonic()
        self._count.update(hashes)

    def expired(self) -> list[str]:
        """The requests whose loads started more than ``timeout_s`` ago."""
        deadline = time.monotonic() - self.timeout_s
        return [r for r, started in self._started.items() if started < deadline]

    def end(self, request_id: str) -> list[int]:
        """The hashes ``request_id`` was loading (none if it was not), no longer in flight."""
        self._started.pop(request_id, None)
        hashes = self._by_request.pop(request_id, [])
        self._count.subtract(hashes)
        self._count = +self._count
        return hashes

    def check_invariants(self, connector: str) -> None:
        expected: Counter[int] = Counter()
        for hashes in self._by_request.values():
            expected.update(hashes)
        if expected != self._count or self._started.keys() != self._by_request.keys():
            raise RuntimeError(
                f"{connector}: the hashes in flight disagree with the loading requests"
            )


class ConnectorMetric(NamedTuple):
    """One of a connector's metrics: a counter (``heron:NAME_total``) or a gauge."""

    name: str
    doc: str
    value: float
    counter: bool


@dataclass(frozen=True)
class KVConnectorMeta:
    """A step's transfers: whatever the connector's scheduler side tells its worker side
    (each connector adds its fields; plain data, so a plan pickles). The runner reads only
    ``load_requests`` (the requests whose loads the step carries) and ``save_keys`` (the
    entries its saves write), to report them failed if the connector raises."""

    load_requests: list[str] = field(default_factory=list)
    save_keys: list[int] = field(default_factory=list)


@dataclass
class TransferResults:
    """What the worker side finished since it was last asked: requests whose loads ended
    (``loaded``) or failed (``failed_loads``), and the keys of entries whose save failed."""

    loaded: list[str] = field(default_factory=list)
    failed_loads: list[str] = field(default_factory=list)
    failed_saves: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loaded or self.failed_loads or self.failed_saves)


class KVConnectorScheduler(ABC):
    """The scheduler's half: which tokens an outside store provides, what each step moves.

    ``loads_outlive_steps``: a load may still write its blocks after its step (a remote
    read), so a request aborted while loading keeps them until the load ends.
    """

    loads_outlive_steps = False

    @abstractmethod
    def lookup(self, request: CachedSequence, num_device_tokens: int) -> ExternalHits:
        """How many tokens past the first ``num_device_tokens`` (the device pool's hit) the
        store can load for ``request`` (whole blocks, leaving its last token to compute)."""

    @abstractmethod
    def load(
        self,
        request: CachedSequence,
        tables: Sequence[Sequence[int]],
        num_device_tokens: int,
        num_tokens: int,
    ) -> None:
        """``request``'s tables (one per cache group) were allocated to hold ``num_tokens``
        tokens from the store after its ``num_device_tokens``: load them this step."""

    @abstractmethod
    def scheduled(
        self,
        request: CachedSequence,
        tables: Sequence[Sequence[int]],
        hashes: Sequence[int],
        num_new: int,
    ) -> None:
        """A step computes ``request``'s ``num_new`` tokens after its computed ones;
        ``hashes``: the chain hashes of its full blocks of known tokens (written by the end of
        the step), ``tables`` its tables."""

    def freed(
        self, request: CachedSequence, tables: Sequence[Sequence[int]], hashes: Sequence[int]
    ) -> None:
        """``request`` gave back its blocks (``tables``, now the pool's to hand out again;
        ``hashes``: every full block of computed, known tokens it registered, those the pool
        registered as it freed them included). Called just before :meth:`forget`; a save of
        them must read them before this pass's step writes into any."""

    def checkpointed(self, group: int, copies: StateCopies) -> None:
        """Cache group ``group``'s state checkpoints that became findable this pass
        (``copies.registered`` and ``copies.confirmed``)."""

    def timed_out(self) -> list[str]:
        """Loading requests whose loads outlasted the connector's timeout: the scheduler
        recomputes their tokens, as for a failed load."""
        return []

    @abstractmethod
    def forget(self, request_id: str) -> None:
        """The request holds no blocks any more (finished, aborted, preempted)."""

    @abstractmethod
    def finished(self, results: TransferResults) -> None:
        """The worker side's results of earlier steps."""

    @abstractmethod
    def take_step_meta(self) -> KVConnectorMeta | None:
        """This pass's transfers (None: none), for the step plan; resets them."""

    def check_params(self, params: dict, num_prompt_tokens: int) -> None:
        """Raise ``ValueError`` naming what of a request's ``kv_transfer_params`` this
        connector cannot serve (checked when the request arrives)."""
        raise ValueError(f"kv_transfer_params: the KV connector ({self.describe()}) takes none")

    def failed_load_error(self, request_id: str) -> str | None:
        """Why ``request_id``, whose load failed, fails too (None: it computes what the load
        did not bring, the default)."""
        return None

    def hold(self, request: CachedSequence, tables: Sequence[Sequence[int]], aborted: bool) -> bool:
        """``request`` finished (or was ``aborted``): whether its blocks stay allocated until
        :meth:`released` names it (for another instance to read them, or while transfers
        from them are in flight)."""
        return False

    def handshake(self) -> dict | None:
        """What another instance needs to know of this one before a request's transfer
        (served as ``GET /kv_transfer``; None: nothing)."""
        return None

    def released(self) -> list[str]:
        """Held requests whose blocks may be freed now (read, or held past a timeout)."""
        return []

    def describe(self) -> str:
        """The connector for the start-up log and ``heron plan``."""
        return type(self).__name__

    def metrics(self) -> list[ConnectorMetric]:
        """The connector's counters and gauges."""
        return []

    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` if the connector's own bookkeeping disagrees with itself."""


class KVConnectorWorker(ABC):
    """The runner's half: the cache tensors, and the transfers a step's metadata names.

    ``layerwise``: saves each layer as soon as its KV is written, waiting in its own thread on
    the runner's :class:`~heron.kv_transfer.layer_steps.LayerSteps` (the runner then records a
    layer step after each cache owner's forward); otherwise :meth:`end_step` saves the whole
    step after its forward pass.
    """

    layerwise = False

    @abstractmethod
    def register_caches(self, layout: CacheLayout, layer_steps: LayerSteps) -> None:
        """Called once the caches are allocated (and again if they are reallocated)."""

    @abstractmethod
    def start_step(self, meta: KVConnectorMeta) -> None:
        """Before the step's forward pass: its loads (raise :class:`KVTransferError` if they
        fail: the runner then reports them failed and the step runs without them)."""

    @abstractmethod
    def end_step(self, meta: KVConnectorMeta) -> None:
        """After the step's forward pass is queued: its saves."""

    @abstractmethod
    def take_results(self) -> TransferResults:
        """What ended since the last call."""

    def shutdown(self) -> None:
        """Stop what runs beside the runner (savers' threads)."""


def refuse_specs(name: str, specs: Sequence[CacheSpec], supported: tuple[type, ...]) -> None:
    """Raise ``ValueError`` naming the first cache group a connector cannot transfer: every
    kind is transferred or the model is refused at start-up, never half-transferred."""
    for g, spec in enumerate(specs):
        if not isinstance(spec, supported):
            raise ValueError(
                f"kv_transfer_config: the {name!r} connector cannot transfer cache group {g} "
                f"({spec.describe()})"
            )
