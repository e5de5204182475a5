"""This process's place in the tensor-parallel group, and the collectives sharded layers run.

Layers read :func:`current_tensor_parallel` when they are built: ``build_model`` enters
:func:`tensor_parallel_scope` around the model's construction, and outside any scope (one
process, the tests' hand-built layers) a layer sees :data:`SINGLE` and shards nothing, so the
one-process path runs no collective and no extra copy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    """Rank ``rank`` of ``size`` ranks; ``group`` carries the model's collectives (NCCL on CUDA,
    gloo on the CPU), None when ``size`` is 1."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None

    def part(self, units: int, what: str, shared: bool = False) -> tuple[int, int]:
        """This rank's ``(first unit, count)`` of ``units`` split evenly over the ranks; with
        ``shared``, fewer units than ranks give each rank one unit it shares (KV heads)."""
        if units % self.size == 0:
            count = units // self.size
            return self.rank * count, count
        if shared and self.size % units == 0:
            return self.rank * units // self.size, 1
        raise ValueError(
            f"tensor_parallel_size={self.size} does not divide {what} ({units})"
            + (f", nor does {what} divide it" if shared else "")
        )

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x``, in place (capturable in a CUDA graph with NCCL)."""
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` [rows, n] side by side: [rows, size * n], rank order."""
        if x.is_cuda:  # one NCCL call into one buffer, capturable
            out = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out, x.contiguous(), group=self.group)
            return out.permute(1, 0, 2).reshape(x.shape[0], -1)
        pieces = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(pieces, x.contiguous(), group=self.group)
        return torch.cat(pieces, dim=-1)


SINGLE = TensorParallel()
_current = SINGLE


def current_tensor_parallel() -> TensorParallel:
    """The group the layers being built shard over (:data:`SINGLE` outside a scope)."""
    return _current


@contextlib.contextmanager
def tensor_parallel_scope(tp: TensorParallel) -> Iterator[TensorParallel]:
    """Layers built inside shard over ``tp``."""
    global _current
    previous, _current = _current, tp
    try:
        yield tp
    finally:
        _current = previous
