"""Weights broadcast from a trainer in another process group (SGLang's
``update_weights_from_distributed``, vLLM's NCCL weight transfer): the trainer is rank 0 of a
group of its own, the engine joins it at ``rank_offset``, and each update is a series of
broadcasts from rank 0, one tensor each, in an order both sides agree on (``names``).

The group is made from a TCP store, apart from any default process group either side runs
(the trainer's own data-parallel world, the engine's tensor-parallel ranks): NCCL on GPUs,
gloo on CPUs. :class:`WeightSender` is the trainer's side: each of its ``send`` calls is one
chunk, received by one ``update_weights_from_distributed`` call of the engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

BACKENDS = ("nccl", "gloo")
_TIMEOUT = timedelta(minutes=10)


def parse_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` or ``"torch.bfloat16"`` as a floating-point torch dtype."""
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype {name!r} is not a floating-point torch dtype")
    return dtype


def _join(
    master_address: str, master_port: int, rank: int, world_size: int, backend: str, master: bool
) -> dist.ProcessGroup:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if world_size < 2 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a weight update group of {world_size}")
    store = dist.TCPStore(master_address, master_port, world_size, master, timeout=_TIMEOUT)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, _TIMEOUT)
    return dist.ProcessGroupNCCL(store, rank, world_size)


def _broadcast(group: dist.ProcessGroup, tensors: Sequence[torch.Tensor]) -> None:
    """Each of ``tensors`` from rank 0, then a barrier: a chunk is over for both sides only
    once every rank has it (a sender whose broadcasts merely left could exit mid-transfer)."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    for tensor in tensors:
        group.broadcast([tensor], options).wait()
    group.barrier(dist.BarrierOptions()).wait()


class WeightUpdateGroup:
    """The engine's side: joined at ``rank_offset`` (its first rank) of ``world_size``."""

    def __init__(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        backend: str,
        device: torch.device,
    ) -> None:
        if rank_offset < 1:
            raise ValueError(f"rank_offset must be >= 1 (the trainer is rank 0), got {rank_offset}")
        self.device = device
        self._group = _join(master_address, master_port, rank_offset, world_size, backend, False)

    def receive(
        self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
    ) -> list[tuple[str, torch.Tensor]]:
        """The tensors rank 0 broadcasts, one per name, all of them (the trainer sends them
        whatever this side thinks of them: they are checked once they are here)."""
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(
                f"got {len(names)} names, {len(dtypes)} dtypes and {len(shapes)} shapes; "
                "give one of each per tensor"
            )
        empty = [
            torch.empty(tuple(shape), dtype=parse_dtype(dtype), device=self.device)
            for dtype, shape in zip(dtypes, shapes)
        ]
        _broadcast(self._group, empty)
        return list(zip(names, empty))

    def close(self) -> None:
        self._group = None


class WeightSender:
    """The trainer's side: rank 0 of the group, which the engine then joins
    (``init_weight_update_group``); :meth:`send` broadcasts while the engine receives
    (``update_weights_from_distributed`` with the same names, dtypes and shapes)."""

    def __init__(
        self, master_address: str, master_port: int, world_size: int, backend: str
    ) -> None:
        self._group = _join(master_address, master_port, 0, world_size, backend, True)

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Broadcast one chunk, which one ``update_weights_from_distributed`` call of the
        engine receives; returns once the engine has it all."""
        _broadcast(self._group, [tensor.contiguous() for _, tensor in named_tensors])

    def close(self) -> None:
        """Leave the group; call it before the process exits (a group still alive when the
        interpreter shuts down may abort it)."""
        self._group = None

    @staticmethod
    def describe(
        named_tensors: Iterable[tuple[str, torch.Tensor]],
    ) -> dict[str, list]:
        """The ``names``, ``dtypes`` and ``shapes`` the engine's call takes for them."""
        pairs = list(named_tensors)
        return {
            "names": [n for n, _ in pairs],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in pairs],
            "shapes": [list(t.shape) for _, t in pairs],
        }
