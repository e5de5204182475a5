"""How the ranks find each other: torchrun's environment, or a local port rank 0's store binds.

Rank 0 hosts the ``TCPStore``; every rank announces itself there before the process groups
form, so rank 0 can watch the workers it started while it waits (one that dies during start-up
is reported by rank, not waited for until a timeout).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from heron.parallel import TensorParallel

# How long the ranks wait for each other to join, and for a collective of the model.
JOIN_TIMEOUT = timedelta(minutes=10)
# Workers wait on the control channel while the engine is idle: they must not time out there.
CONTROL_TIMEOUT = timedelta(days=365)


@dataclass(frozen=True)
class Rendezvous:
    """Where rank 0's store listens, how many ranks there are and which one this is."""

    master_addr: str
    master_port: int
    world_size: int
    rank: int = 0
    local_rank: int = 0  # the GPU of its host this rank drives

    @classmethod
    def from_env(cls) -> Rendezvous | None:
        """The rendezvous torchrun describes (``MASTER_ADDR``, ``MASTER_PORT``,
        ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``), or None outside such a launch."""
        env = os.environ
        if "RANK" not in env or "WORLD_SIZE" not in env:
            return None
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env]
        if missing:
            raise ValueError(f"RANK and WORLD_SIZE are set but not {', '.join(missing)}")
        rank = int(env["RANK"])
        return cls(
            env["MASTER_ADDR"],
            int(env["MASTER_PORT"]),
            int(env["WORLD_SIZE"]),
            rank,
            int(env.get("LOCAL_RANK", rank)),
        )

    def for_rank(self, rank: int) -> Rendezvous:
        return replace(self, rank=rank, local_rank=rank)


def host_store(world_size: int) -> tuple[Rendezvous, dist.TCPStore]:
    """Rank 0 of ``world_size`` ranks started here, and its store, listening on a port of
    127.0.0.1 the OS picks as the store binds (a port found free and released first can be
    taken by another process before the store binds it)."""
    store = _store("127.0.0.1", 0, world_size, True)
    return Rendezvous("127.0.0.1", store.port, world_size), store


def _store(addr: str, port: int, world_size: int, is_master: bool) -> dist.TCPStore:
    return dist.TCPStore(
        addr, port, world_size, is_master=is_master, timeout=JOIN_TIMEOUT, wait_for_workers=False
    )


def _joined(rank: int) -> str:
    return f"heron/joined/{rank}"


def join(
    rv: Rendezvous,
    device_type: str,
    watch: Callable[[], None] | None = None,
    store: dist.TCPStore | None = None,
) -> tuple[TensorParallel, dist.ProcessGroup]:
    """Form the process groups: the model's (NCCL on CUDA, gloo on the CPU) and the control
    channel (gloo, host memory), through ``store`` (rank 0's, from :func:`host_store`) or one
    made from ``rv``. Rank 0 calls ``watch`` while it waits for the others to join; it raises
    for a worker that died."""
    if store is None:
        store = _store(rv.master_addr, rv.master_port, rv.world_size, rv.rank == 0)
    store.set(_joined(rv.rank), "1")
    if rv.rank == 0:
        deadline = time.monotonic() + JOIN_TIMEOUT.total_seconds()
        waiting = [_joined(r) for r in range(1, rv.world_size)]
        while not store.check(waiting):
            if watch is not None:
                watch()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"tensor-parallel ranks did not join {rv.master_addr}:{rv.master_port} "
                    f"within {JOIN_TIMEOUT}"
                )
            time.sleep(0.05)
    if device_type == "cuda":
        torch.cuda.set_device(rv.local_rank)
    dist.init_process_group(
        "nccl" if device_type == "cuda" else "gloo",
        store=store,
        rank=rv.rank,
        world_size=rv.world_size,
        timeout=JOIN_TIMEOUT,
    )
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return TensorParallel(rv.rank, rv.world_size, dist.group.WORLD), control


def min_over_ranks(value: int, control: dist.ProcessGroup) -> int:
    """The smallest of every rank's ``value`` (each rank's KV budget: the pool must fit all)."""
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=control)
    return int(t.item())
