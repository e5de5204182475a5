"""Cache groups from the operators' specs: who shares which pool, how big each pool is.

Operators with equal specs form one cache group (one pool, one table per request); every
operator still gets a tensor of its own, shaped by its spec.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from heron.cache.spec import CacheSpec


class CacheOwner(Protocol):
    """An operator that declares its cache (``cache_spec``) and reads the tensor it is given."""

    layer_name: str

    @property
    def cache_spec(self) -> CacheSpec: ...

    def bind_cache(self, cache: torch.Tensor | tuple | None) -> None: ...


class CacheLayout:
    """The model's cache groups, in order of first appearance, and each owner's group."""

    def __init__(self, owners: Sequence[CacheOwner]) -> None:
        self.owners = list(owners)
        self._caches: list[torch.Tensor | tuple] = []  # each owner's, while allocated
        self.specs: list[CacheSpec] = []
        self.owner_groups: list[int] = []
        for owner in self.owners:
            spec = owner.cache_spec
            if spec not in self.specs:
                self.specs.append(spec)
            self.owner_groups.append(self.specs.index(spec))

    @property
    def num_groups(self) -> int:
        return len(self.specs)

    @property
    def caches(self) -> list[torch.Tensor | tuple]:
        """Each owner's cache, in owner order, while allocated (a KV connector's view)."""
        return self._caches

    def group_layers(self, group: int) -> list[str]:
        return [o.layer_name for o, g in zip(self.owners, self.owner_groups) if g == group]

    def bytes_per_block(self) -> list[int]:
        """Per group, the bytes one block takes over all its owners."""
        per_group = [0] * self.num_groups
        for owner, g in zip(self.owners, self.owner_groups):
            per_group[g] += owner.cache_spec.bytes_per_block
        return per_group

    def blocks_per_seq(self, max_model_len: int, max_num_batched_tokens: int) -> list[int]:
        return [s.blocks_per_seq(max_model_len, max_num_batched_tokens) for s in self.specs]

    def split_budget(
        self,
        budget: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        max_num_seqs: int | None = None,
        max_running: int | None = None,
        state_checkpoints: bool = False,
    ) -> list[int]:
        """Pool size (null block included) of each group for ``budget`` bytes.

        Every group fits the same number of max-length sequences: with ``b_g`` blocks per
        sequence and ``B_g`` bytes per block, ``S = (budget - sum B_g) / sum(b_g * B_g)`` and
        group ``g`` gets ``floor(S * b_g) + 1`` blocks (the ``+ 1`` is its null block), at most
        what ``max_num_seqs`` sequences can hold when given.

        Groups of one entry per request (``spec.per_request``) need no more entries than
        requests run at once: given ``max_running``, they get ``max_running + 1`` when the
        rest of the budget still holds a max-length sequence in every other group, and the
        other groups split that rest as above. Short requests are then not bounded by how many
        max-length ones would fit. With ``state_checkpoints`` (prefix caching) such a group
        counts two entries per request: its slot and a checkpoint's worth of cached prefixes.
        """
        per_block = self.bytes_per_block()
        per_seq = self.blocks_per_seq(max_model_len, max_num_batched_tokens)
        fixed = [spec.per_request for spec in self.specs]
        if state_checkpoints:
            per_seq = [2 * b if f else b for b, f in zip(per_seq, fixed)]
        if max_running is not None and any(fixed) and not all(fixed):
            reserved = sum(
                (max_running * b + 1) * B for b, B, f in zip(per_seq, per_block, fixed) if f
            )
            growing = [(b, B) for b, B, f in zip(per_seq, per_block, fixed) if not f]
            usable = budget - reserved - sum(B for _, B in growing)
            bytes_per_seq = sum(b * B for b, B in growing)
            if usable >= bytes_per_seq:
                num_blocks = [
                    max_running * b + 1 if f else usable * b // bytes_per_seq + 1
                    for b, f in zip(per_seq, fixed)
                ]
                return self._capped(num_blocks, per_seq, max_num_seqs)
        bytes_per_seq = sum(b * B for b, B in zip(per_seq, per_block))
        usable = max(0, budget - sum(per_block))
        num_blocks = [usable * b // bytes_per_seq + 1 for b in per_seq]
        return self._capped(num_blocks, per_seq, max_num_seqs)

    @staticmethod
    def _capped(num_blocks: list[int], per_seq: list[int], max_num_seqs: int | None) -> list[int]:
        if max_num_seqs is None:
            return num_blocks
        return [min(n, max_num_seqs * b + 1) for n, b in zip(num_blocks, per_seq)]

    def check_fits(
        self, num_blocks: Sequence[int], max_model_len: int, max_num_batched_tokens: int
    ) -> None:
        """Raise ``ValueError`` unless every group holds one sequence of ``max_model_len``."""
        per_seq = self.blocks_per_seq(max_model_len, max_num_batched_tokens)
        for spec, n, b in zip(self.specs, num_blocks, per_seq):
            if n - 1 < b:
                raise ValueError(
                    f"the cache group ({spec.describe()}) holds {n - 1} blocks, fewer than one "
                    f"sequence of max_model_len={max_model_len} needs ({b}); lower "
                    "max_model_len or give the cache more memory"
                )

    def allocate(self, num_blocks: Sequence[int], device: torch.device) -> None:
        """Give every owner its zeroed cache over its group's pool of ``num_blocks[g]``."""
        self._caches = [
            owner.cache_spec.allocate(num_blocks[g], device)
            for owner, g in zip(self.owners, self.owner_groups)
        ]
        for owner, cache in zip(self.owners, self._caches):
            owner.bind_cache(cache)

    def copy_entries(self, group: int, sources: list[int], destinations: list[int]) -> None:
        """In every cache tensor of ``group`` (a kind of per-request entries, indexed first),
        entry ``destinations[i]`` becomes entry ``sources[i]``; all are read before any is
        written, so a destination may be another pair's source."""
        if not self.specs[group].per_request:
            raise ValueError(
                f"cache group {group} ({self.specs[group].describe()}) has no entry copies"
            )
        tensors = [
            t for cache, g in zip(self._caches, self.owner_groups) if g == group for t in cache
        ]
        index = torch.tensor([sources, destinations])
        if tensors[0].is_cuda:  # pinned, so the upload does not wait for the step in flight
            index = index.pin_memory()
        index = index.to(tensors[0].device, non_blocking=True)
        for tensor in tensors:
            tensor.index_copy_(0, index[1], tensor[index[0]])

    def release(self) -> None:
        self._caches = []
        for owner in self.owners:
            owner.bind_cache(None)
