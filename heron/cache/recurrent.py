"""The recurrent-state cache kind: one state slot per running request (gated-delta-rule layers).

A slot holds, per layer of the group, the causal convolution's last inputs and the recurrent
state. Its size does not grow with the sequence, so a request takes one slot on its first
allocation and keeps it until it is finished, aborted or preempted. Slot 0 is the null slot
(padded graph rows read and write it). The slot reaches the runner as the request's one-entry
table of the group; the state copies into and out of checkpoints reach it as plan fields.
"""

from __future__ import annotations

import sys
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from heron.cache.block_pool import BlockPool
from heron.cache.manager import (
    NO_HEADROOM,
    AllocationHeadroom,
    CachedSequence,
    CacheManager,
    refuse_late_hits,
)
from heron.cache.recurrent_parts import RecurrentStepParts
from heron.cache.spec import CacheSpec

NULL_SLOT = 0


@dataclass(frozen=True)
class RecurrentStateSpec(CacheSpec):
    """Per slot: ``conv_state [conv_dim, conv_kernel - 1]`` in ``dtype`` (the model's) and
    ``recurrent_state [num_heads, key_dim, value_dim]`` in ``state_dtype`` (fp32 unless the
    config's ``mamba_ssm_dtype`` says otherwise).

    ``block_size`` is 1: a slot is one entry, one per request. The kind does not take part in
    the chain of prefix block hashes; it serves prefix hits from state checkpoints, entries of
    the same pool keyed by the chain hash of the prefix they hold.
    """

    conv_dim: int
    conv_kernel: int
    num_heads: int
    key_dim: int
    value_dim: int
    state_dtype: torch.dtype = torch.float32

    joins_prefix_chain = False
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

    def step_parts(self) -> RecurrentStepParts:
        return RecurrentStepParts()

    def allocate(self, num_blocks: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(conv_state [slots, *conv_shape], recurrent_state [slots, *state_shape])``."""
        return (
            torch.zeros((num_blocks, *self.conv_shape), dtype=self.dtype, device=device),
            torch.zeros((num_blocks, *self.state_shape), dtype=self.state_dtype, device=device),
        )

    def make_manager(
        self, num_blocks: int, enable_prefix_caching: bool, chain_block_size: int
    ) -> CacheManager:
        return RecurrentStateManager(self, num_blocks, enable_prefix_caching, chain_block_size)

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


@dataclass(slots=True)
class _RequestSlot:
    slot: int
    # The step-end token count of the request's next checkpoint (sys.maxsize: none left).
    next_checkpoint: int


class RecurrentStateManager(CacheManager):
    """Hands out state slots and keeps state checkpoints of cached prefixes, in one pool.

    A request takes one entry as its slot on its first allocation; :meth:`free` returns it.
    With prefix caching, a step that ends on a boundary of the prefix chain's blocks
    (``chain_block_size`` tokens) inside the prompt also takes an entry to save the slot's state
    into at step end, registered under the chain hash of the prefix it holds. Such a checkpoint
    is held until :meth:`take_state_copies` seals the pass (so no request of the same pass can
    hit a state not saved yet), then joins the free queue's tail: it stays findable until the
    LRU queue hands it out again, as a slot or a checkpoint (free entries and evictable
    checkpoints are one budget). A freed slot joins the head: it holds no checkpoint. A hit
    starts the request from a copy of the checkpoint in its slot. A save is skipped when no
    entry is free: checkpoints never make a step wait.
    """

    def __init__(
        self,
        spec: RecurrentStateSpec,
        num_blocks: int,
        enable_prefix_caching: bool = False,
        chain_block_size: int = 1,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (slot 0 is reserved), got {num_blocks}")
        self.spec = spec
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.chain_block_size = chain_block_size
        self._pool = BlockPool(num_blocks)
        self._requests: dict[str, _RequestSlot] = {}
        self._tables: dict[str, list[int]] = {}  # request -> [its slot]
        # This pass's copies: (checkpoint, slot) before the step, (slot, checkpoint) after it,
        # and the hash each saved checkpoint is registered under once the pass is sealed.
        self._restores: list[tuple[int, int]] = []
        self._saves: list[tuple[int, int]] = []
        self._pending: dict[int, int] = {}  # checkpoint -> hash

    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free

    def find_cached_chain(
        self, request: CachedSequence, hashes: list[int] | None = None
    ) -> list[int]:
        """The longest prefix of ``hashes`` (the chain's, as far as the other groups hold it)
        ending at a checkpoint: null entries, then the checkpoint."""
        if not hashes:
            return []
        cached = self._pool.cached
        for i in range(len(hashes), 0, -1):
            checkpoint = cached.get(hashes[i - 1])
            if checkpoint is not None:
                return [NULL_SLOT] * (i - 1) + [checkpoint]
        return []

    def check_hits(self, request: CachedSequence, hits: Sequence[int]) -> None:
        # Only the last hit is a slot (a checkpoint); the null slots before it hold nothing.
        if hits:
            refuse_late_hits(request, self._requests, self._pool, hits[-1:], "a state checkpoint")

    def chunk_end(self, request: CachedSequence, start: int, end: int) -> int:
        """The last checkpoint boundary inside the prompt in ``(start, end)``, else ``end``:
        a prefill chunk cut there leaves a state to save, for later prompts sharing it."""
        if not self.enable_prefix_caching:
            return end
        bs = self.chain_block_size
        boundary = min(end, request.num_prompt_tokens) // bs * bs
        return boundary if start < boundary < end else end

    def plan(self, request: CachedSequence, num_new_tokens: int, hits: Sequence[int]) -> SlotPlan:
        return SlotPlan(0 if request.request_id in self._requests else 1)

    def commit(
        self,
        request: CachedSequence,
        num_new_tokens: int,
        hits: Sequence[int],
        plan: SlotPlan,
        chain: Sequence[int] = (),
    ) -> None:
        pool = self._pool
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._take_slot(request, hits[-1] if hits else None)
        if not self.enable_prefix_caching:
            return
        bs = self.chain_block_size
        end = request.num_computed_tokens + len(hits) * bs + num_new_tokens
        if end % bs == 0 and bs <= end <= request.num_prompt_tokens and end // bs <= len(chain):
            block_hash = chain[end // bs - 1]
            if (
                block_hash not in pool.cached
                and block_hash not in self._pending.values()
                and pool.num_free
            ):
                checkpoint: list[int] = []
                pool.take(1, checkpoint)
                self._pending[checkpoint[0]] = block_hash
                self._saves.append((state.slot, checkpoint[0]))
        following = (end // bs + 1) * bs
        state.next_checkpoint = following if following <= request.num_prompt_tokens else sys.maxsize

    def _take_slot(self, request: CachedSequence, checkpoint: int | None) -> _RequestSlot:
        """The request's slot, filled from ``checkpoint`` (its hit) before its first step. The
        checkpoint is kept from being handed out as the slot while another entry is free, and
        moves to the queue's tail (the most recently used); else it becomes the slot itself,
        its state already in place."""
        pool = self._pool
        keep = checkpoint is not None and pool.num_free > 1
        if keep:
            pool.touch([checkpoint])
        table: list[int] = []
        pool.take(1, table)
        state = self._requests[request.request_id] = _RequestSlot(table[0], sys.maxsize)
        self._tables[request.request_id] = table
        if keep:
            self._restores.append((checkpoint, state.slot))
            pool.release([checkpoint])
        return state

    def take_state_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This pass's restores and saves; seals the pass: its checkpoints become findable."""
        restores, saves = self._restores, self._saves
        self._restores, self._saves = [], []
        pool = self._pool
        for checkpoint, block_hash in self._pending.items():
            pool.register(checkpoint, block_hash)
        pool.release(self._pending)
        self._pending = {}
        return restores, saves

    def headroom(self, request_id: str) -> AllocationHeadroom:
        """A step needs nothing until it ends at the request's next checkpoint."""
        state = self._requests.get(request_id)
        if state is None:
            return NO_HEADROOM
        return AllocationHeadroom(state.next_checkpoint - 1, sys.maxsize)

    def truncate(self, request: CachedSequence, num_tokens: int) -> None:
        """Nothing to give back: the slot stays, and the runner puts back the state the
        accepted tokens left (proposals come after the prompt, where no checkpoint is saved)."""

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def block_hashes(self, request_id: str) -> Sequence[int]:
        return ()

    def request_ids(self) -> Collection[str]:
        return self._requests.keys()

    def free(self, request: CachedSequence) -> None:
        """A save the request's step of this pass planned is dropped with its slot (freed in
        the same pass, the slot may serve another request before the step ends)."""
        state = self._requests.pop(request.request_id, None)
        if state is None:
            return
        del self._tables[request.request_id]
        dropped = [c for s, c in self._saves if s == state.slot]
        if dropped:
            self._saves = [(s, c) for s, c in self._saves if s != state.slot]
            for checkpoint in dropped:
                del self._pending[checkpoint]
        self._pool.release_to_head([state.slot, *dropped])  # no checkpoint among them

    def reset_prefix_cache(self) -> bool:
        return self._pool.reset_hashes()

    def check_invariants(self) -> None:
        if any(
            table != [s.slot] for table, s in zip(self._tables.values(), self._requests.values())
        ):
            raise RuntimeError("a request's table is other than its one slot")
        if self._tables.keys() != self._requests.keys():
            raise RuntimeError("slot tables kept for requests holding no slot")
        self._pool.check_invariants(
            [[s.slot] for s in self._requests.values()] + [list(self._pending)]
        )
        if not self.enable_prefix_caching and (self._pool.cached or self._pending):
            raise RuntimeError("state checkpoints kept with prefix caching off")
