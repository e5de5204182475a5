"""Layerwise KV transfer: a prefill instance WRITEs each layer's blocks to the decode instance
while its later layers still compute.

The decode instance allocates the prompt's blocks first and sends their ids
(:class:`Destination`) to the prefill instance, whose request waits for them. Each step that
computes the prompt then carries a :class:`LayerwiseSave` of the destination's blocks it
touches; the :class:`Pusher`'s thread WRITEs layer ``l`` of them once the runner's
:class:`~heron.kv_transfer.layer_steps.LayerSteps` shows it written (blocks complete before
the step go at once), tells the decode instance of each step's writes (``progress``: it waits
on) and, after the prompt's last chunk, that the transfer is complete (``written``), or that
it is not.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from heron.cache.block_pool import NULL_BLOCK_ID
from heron.kv_transfer.nixl_agent import LayerRegion, descriptors

if TYPE_CHECKING:
    from heron.kv_transfer.layer_steps import LayerSteps
    from heron.kv_transfer.nixl_agent import NixlAgent

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Destination:
    """Where a transfer's blocks go: the decode instance's agent and cache regions, and per
    cache group its blocks for the prompt's blocks ``first_block`` on (none: nothing wanted,
    its own cache holds the prompt)."""

    transfer_id: str
    engine_id: str
    agent_metadata: str
    layers: list[list[Any]]
    first_block: int
    block_ids: list[list[int]]

    def message(self) -> dict:
        return {"kind": "destination", **asdict(self)}

    @classmethod
    def of(cls, message: dict) -> Destination:
        return cls(**{k: v for k, v in message.items() if k != "kind"})

    @property
    def end_block(self) -> int:
        return self.first_block + max((len(ids) for ids in self.block_ids), default=0)


@dataclass(frozen=True)
class LayerwiseSave:
    """One step's writes of a request: per cache group its ``local`` blocks to the
    ``remote`` ones; the first ``num_ready`` of them were complete before the step (written
    at once), the rest are written layer by layer. ``last``: the prompt's last chunk."""

    request_id: str
    destination: Destination
    local: list[list[int]]
    remote: list[list[int]]
    num_ready: int
    last: bool

    @property
    def waits(self) -> bool:
        """Whether some block waits for the step's layers."""
        return any(len(ids) > self.num_ready for ids in self.local)


@dataclass
class Binding:
    """A prefill request's destination, and the first block its next step writes."""

    destination: Destination
    next_block: int = field(init=False)
    done: bool = False

    def __post_init__(self) -> None:
        self.next_block = self.destination.first_block

    def save(
        self,
        request_id: str,
        tables: Sequence[Sequence[int]],
        num_computed: int,
        num_new: int,
        num_prompt_tokens: int,
        block_size: int,
    ) -> LayerwiseSave | None:
        """The writes of a step computing ``num_new`` tokens after ``num_computed``: the
        destination's blocks from the first this step writes into (or an earlier one not
        written yet) to the last it touches; None once the prompt was written."""
        if self.done:
            return None
        dest = self.destination
        first = max(dest.first_block, min(self.next_block, num_computed // block_size))
        end = min(-(-(num_computed + num_new) // block_size), dest.end_block)
        last = num_computed + num_new >= num_prompt_tokens
        self.next_block, self.done = max(self.next_block, end), last
        if first >= end and not last:
            return None
        # A block is complete once its tokens the decode side needs (all but the prompt's
        # last) are: those computed before the step go at once.
        needed = num_prompt_tokens - 1
        num_ready = sum(
            1 for i in range(first, end) if min((i + 1) * block_size, needed) <= num_computed
        )
        span = slice(first - dest.first_block, max(first, end) - dest.first_block)
        return LayerwiseSave(
            request_id,
            dest,
            [list(table[first : max(first, end)]) for table in tables],
            [ids[span] for ids in dest.block_ids],
            num_ready,
            last,
        )


@dataclass
class _Push:
    """A request's writes in flight and what they moved."""

    handles: list[Any] = field(default_factory=list)
    blocks: set[tuple[int, int]] = field(default_factory=set)  # (group, remote block)
    bytes: int = 0  # (a block a later chunk completes is written again)
    start: float = field(default_factory=time.monotonic)
    complete: bool = True  # (no write failed)
    told: bool = False  # (the decode instance was told how it ended)


class Pusher:
    """The prefill instance's saver: a thread that WRITEs each step's saves as the layer steps
    show their layers written, and tells the decode instance how each transfer ended. Its
    requests' blocks stay allocated until it names them in ``ended`` (every write of theirs
    ended). ``timeout_s``: how long a layer or a write may take before the transfer fails."""

    def __init__(self, agent: NixlAgent, timeout_s: float) -> None:
        self.agent = agent
        self.timeout_s = timeout_s
        self.ended: deque[str] = deque()
        self._steps: LayerSteps | None = None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._pushes: dict[str, _Push] = {}
        self._thread: threading.Thread | None = None

    def start(self, layer_steps: LayerSteps) -> None:
        self._steps = layer_steps
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="heron-kv-push", daemon=True)
            self._thread.start()

    def submit(self, saves: list[LayerwiseSave]) -> None:
        """A step's saves, before its forward pass is queued."""
        self._jobs.put((self._save, (self._steps.settled(), saves)))

    def close(self, request_id: str, destination: Destination) -> None:
        """The request finished or was aborted: once its writes ended, the decode side learns
        that the transfer is not complete (unless its last chunk told it already), and the
        request is named in ``ended``."""
        self._jobs.put((self._close, (request_id, destination)))

    def cancel(self, request_id: str | None, destination: Destination) -> None:
        """The decode side gave the transfer up: no write of it starts any more, and once
        those in flight ended the decode side is told (at once for a request not bound yet:
        ``None``)."""
        self._jobs.put((self._cancel, (request_id, destination)))

    def shutdown(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(self.timeout_s)
            self._thread = None

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            call, args = job
            try:
                call(*args)
            except Exception:
                logger.exception("the layerwise KV saver failed a job")

    def _save(self, base: int, saves: list[LayerwiseSave]) -> None:
        for save in saves:  # (a block this step rewrites: its earlier write lands first)
            self._settle(save.request_id)
        layers = self.agent.layers
        for save in saves:
            for layer in range(len(layers)):
                self._write(save, layer, slice(0, save.num_ready))
        for layer in range(len(layers)):
            if any(s.waits for s in saves) and not self._steps.wait_for(
                base + layer + 1, self.timeout_s
            ):
                logger.warning("layer %d was not written within %g s", layer, self.timeout_s)
                for save in saves:
                    self._push(save.request_id).complete = False
                break
            for save in saves:
                self._write(save, layer, slice(save.num_ready, None))
        for save in saves:
            if save.last:
                self._tell(save.request_id, save.destination)
            elif self._pushes[save.request_id].complete:  # (the decode side waits on)
                self._send(save.destination, {"kind": "progress"})

    def _push(self, request_id: str) -> _Push:
        push = self._pushes.get(request_id)
        if push is None:
            push = self._pushes[request_id] = _Push()
        return push

    def _write(self, save: LayerwiseSave, layer: int, blocks: slice) -> None:
        """WRITE layer ``layer`` of the save's ``blocks``."""
        push = self._push(save.request_id)
        if not push.complete:
            return
        agent, ours = self.agent, self.agent.layers[layer]
        theirs = LayerRegion(*save.destination.layers[layer])
        g = ours.group
        pairs = [
            p for p in zip(save.local[g][blocks], save.remote[g][blocks]) if NULL_BLOCK_ID not in p
        ]
        local, remote = descriptors(ours, theirs, pairs)
        written = [(g, rb) for _, rb in pairs]
        if not local:
            return
        try:
            name = agent.remote(save.destination.engine_id, save.destination.agent_metadata)
            handle = agent.agent.initialize_xfer(
                "WRITE",
                agent.agent.get_xfer_descs(local, ours.memory),
                agent.agent.get_xfer_descs(remote, ours.memory),
                name,
            )
            push.handles.append(handle)
            if agent.agent.transfer(handle) == "ERR":
                raise RuntimeError("the WRITE failed to start")
        except Exception:
            logger.exception("request %s: a layerwise KV write failed", save.request_id)
            push.complete = False
            return
        push.blocks.update(written)
        push.bytes += sum(d[1] for d in local)

    def _settle(self, request_id: str) -> None:
        """Wait for the request's writes in flight to end (failed: the transfer is not
        complete), and release them."""
        push = self._pushes.get(request_id)
        if push is None:
            return
        deadline = time.monotonic() + self.timeout_s
        for handle in push.handles:
            while (state := self._state(handle)) == "PROC" and time.monotonic() < deadline:
                time.sleep(1e-4)
            push.complete &= state == "DONE"
            try:
                self.agent.agent.release_xfer_handle(handle)
            except Exception:
                logger.exception("a layerwise KV write's handle could not be released")
        push.handles = []

    def _state(self, handle: Any) -> str:
        try:
            return self.agent.agent.check_xfer_state(handle)
        except Exception:
            logger.exception("a layerwise KV write failed")
            return "ERR"

    def _tell(self, request_id: str, destination: Destination) -> None:
        """Once its writes ended, tell the decode side whether the transfer is complete."""
        push = self._push(request_id)
        self._settle(request_id)
        if push.told:
            return
        push.told = True
        self._notify(destination, push.complete)
        if push.complete:
            stats = self.agent.stats
            stats.blocks += len(push.blocks)
            stats.bytes += push.bytes
            stats.seconds += time.monotonic() - push.start

    def _cancel(self, request_id: str | None, destination: Destination) -> None:
        if request_id is None:
            self._notify(destination, complete=False)
            return
        self._push(request_id).complete = False
        self._tell(request_id, destination)

    def _notify(self, destination: Destination, complete: bool) -> None:
        self._send(destination, {"kind": "written", "complete": complete})

    def _send(self, destination: Destination, message: dict) -> None:
        message["transfer_id"] = destination.transfer_id
        try:
            self.agent.send(destination.engine_id, destination.agent_metadata, message)
        except Exception:  # (the decode side then gives up at its timeout)
            logger.exception(
                "transfer %s: the decode instance was not told", destination.transfer_id
            )

    def _close(self, request_id: str, destination: Destination) -> None:
        try:
            push = self._push(request_id)
            push.complete &= push.told
            self._tell(request_id, destination)
        finally:  # (its blocks are freed: a failure here must not keep them)
            self._pushes.pop(request_id, None)
            self.ended.append(request_id)
