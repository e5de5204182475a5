"""The recurrent-state cache kind: one state slot per running request (gated-delta-rule layers).

A slot holds, per layer of the group, the causal convolution's last inputs and the recurrent
state. Its size does not grow with the sequence, so a request takes one slot on its first
allocation and keeps it until it is finished, aborted or preempted. Slot 0 is the null slot
(padded graph rows read and write it). The slot reaches the runner as the request's one-entry
table of the group.
"""

from __future__ import annotations

import sys
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from heron.cache.manager import NO_HEADROOM, AllocationHeadroom, CacheManager
from heron.cache.recurrent_parts import RecurrentStepParts
from heron.cache.spec import CacheSpec

if TYPE_CHECKING:
    from heron.engine.request import Request

NULL_SLOT = 0

# A request holding its slot needs nothing more for any step.
_UNBOUNDED = AllocationHeadroom(sys.maxsize, sys.maxsize)


@dataclass(frozen=True)
class RecurrentStateSpec(CacheSpec):
    """Per slot: ``conv_state [conv_dim, conv_kernel - 1]`` in ``dtype`` (the model's) and
    ``recurrent_state [num_heads, key_dim, value_dim]`` in ``state_dtype`` (fp32 unless the
    config's ``mamba_ssm_dtype`` says otherwise).

    ``block_size`` is 1: a slot is one entry, one per request. The kind does not take part in
    the chain of prefix block hashes, and serves no prefix hits (it keeps no state checkpoints).
    """

    conv_dim: int
    conv_kernel: int
    num_heads: int
    key_dim: int
    value_dim: int
    state_dtype: torch.dtype = torch.float32

    joins_prefix_chain = False
    serves_prefix_hits = False
    per_request = True

    @property
    def conv_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_kernel - 1)

    @property
    def state_shape(self) -> tuple[int, int, int]:
        return (self.num_heads, self.key_dim, self.value_dim)

    @property
    def bytes_per_block(self) -> int:
        state_size = torch.empty((), dtype=self.state_dtype).element_size()
        return (
            int(np.prod(self.conv_shape)) * self._element_size()
            + int(np.prod(self.state_shape)) * state_size
        )

    def blocks_per_seq(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        return 1

    def table_width(self, max_model_len: int) -> int:
        return 1

    def step_parts(self) -> RecurrentStepParts:
        return RecurrentStepParts()

    def allocate(self, num_blocks: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(conv_state [slots, *conv_shape], recurrent_state [slots, *state_shape])``."""
        return (
            torch.zeros((num_blocks, *self.conv_shape), dtype=self.dtype, device=device),
            torch.zeros((num_blocks, *self.state_shape), dtype=self.state_dtype, device=device),
        )

    def make_manager(self, num_blocks: int, enable_prefix_caching: bool) -> CacheManager:
        return RecurrentStateManager(self, num_blocks)

    def describe(self) -> str:
        dtype = lambda d: str(d).removeprefix("torch.")
        return (
            f"recurrent state: one slot per request, conv {self.conv_dim}x{self.conv_kernel - 1} "
            f"{dtype(self.dtype)}, state {self.num_heads}x{self.key_dim}x{self.value_dim} "
            f"{dtype(self.state_dtype)}"
        )


class SlotPlan(NamedTuple):
    """A step's allocation in a recurrent group: one slot for a request that has none."""

    num_needed: int


class RecurrentStateManager(CacheManager):
    """Hands out state slots: a request's first allocation takes one, :meth:`free` returns it.

    Slots are given lowest first, so a short run touches few of them. No hits are served: a
    request always starts from an empty state (its ``num_computed_tokens`` is 0 on admission).
    """

    def __init__(self, spec: RecurrentStateSpec, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (slot 0 is reserved), got {num_blocks}")
        self.spec = spec
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, NULL_SLOT, -1))  # popped from the end
        self._slots: dict[str, list[int]] = {}  # request -> [its slot] (its table)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def find_cached_chain(self, request: Request, hashes: list[int] | None = None) -> list[int]:
        return []

    def check_hits(self, request: Request, hits: Sequence[int]) -> None:
        if hits:
            raise ValueError(
                f"request {request.request_id}: a recurrent-state group serves no prefix hits"
            )

    def plan(self, request: Request, num_new_tokens: int, hits: Sequence[int]) -> SlotPlan:
        return SlotPlan(0 if request.request_id in self._slots else 1)

    def commit(
        self,
        request: Request,
        num_new_tokens: int,
        hits: Sequence[int],
        plan: SlotPlan,
        chain: Sequence[int] = (),
    ) -> None:
        if plan.num_needed:
            self._slots[request.request_id] = [self._free.pop()]

    def headroom(self, request_id: str) -> AllocationHeadroom:
        return _UNBOUNDED if request_id in self._slots else NO_HEADROOM

    def block_table(self, request_id: str) -> list[int]:
        return self._slots.get(request_id, [])

    def block_hashes(self, request_id: str) -> Sequence[int]:
        return ()

    def request_ids(self) -> Collection[str]:
        return self._slots.keys()

    def free(self, request: Request) -> None:
        table = self._slots.pop(request.request_id, None)
        if table is not None:
            self._free.append(table[0])

    def reset_prefix_cache(self) -> bool:
        return len(self._free) == self.num_blocks - 1

    def check_invariants(self) -> None:
        held = [table[0] for table in self._slots.values()]
        if any(len(table) != 1 for table in self._slots.values()):
            raise RuntimeError("a request holds other than one slot")
        everything = sorted(held + self._free)
        if everything != list(range(1, self.num_blocks)):
            raise RuntimeError(
                f"slots leaked, duplicated or null: held {sorted(held)}, free {sorted(self._free)}"
            )
