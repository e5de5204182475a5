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
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from heron.cache.block_pool import BlockPool
from heron.cache.manager import (
    NO_HEADROOM,
    AllocationHeadroom,
    CachedSequence,
    CacheManager,
    StateCopies,
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
    block_axis = 0  # (both tensors' slot axis: what a KV connector copies along)

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
        self,
        num_blocks: int,
        enable_prefix_caching: bool,
        chain_block_size: int,
        decode_checkpoint_interval: int,
    ) -> CacheManager:
        return RecurrentStateManager(
            self, num_blocks, enable_prefix_caching, chain_block_size, decode_checkpoint_interval
        )

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
    # Checkpoints of generated tokens planned while some of their tokens were not known (still
    # being sampled, or proposals): (boundary, entry), held until the chain has their hash.
    unconfirmed: list[tuple[int, int]] = field(default_factory=list)
    # The newest checkpoint of generated tokens off the interval's grid, (boundary, entry):
    # the next one replaces it.
    latest: tuple[int, int] | None = None
    # The request's ``keep_state_at`` and the entry keeping that state (NULL_SLOT: none yet).
    keep_at: int = 0
    kept: int = NULL_SLOT


class RecurrentStateManager(CacheManager):
    """Hands out state slots and keeps state checkpoints of cached prefixes, in one pool.

    A request takes one entry as its slot on its first allocation; :meth:`free` returns it.
    One whose ``keep_state_at`` is set (a prefill instance's prompt, for a decode instance to
    read) also takes an entry that keeps the state after that many tokens: its steps end
    there (:meth:`chunk_end`) and the slot is copied into it (:meth:`transfer_table`).
    With prefix caching, a step that ends on a boundary of the prefix chain's blocks
    (``chain_block_size`` tokens) also takes an entry to save the slot's state into at step
    end, registered under the chain hash of the prefix it holds: inside the prompt where a
    prefill chunk ends (:meth:`chunk_end` cuts chunks there), and at every boundary of the
    generated tokens, so the next turn of a conversation resumes after the previous answer.
    A verification step saves the state its row reached at each boundary among its tokens
    (:class:`StateCopies`' ``verified``), which the runner writes only for accepted tokens.

    A checkpoint whose tokens are all known is held until :meth:`take_state_copies` seals the
    pass (so no request of the same pass can hit a state not saved yet); one whose tokens are
    not (a token still being sampled, proposals) is held by its request until the chain has
    its hash, i.e. its tokens are known and accepted (:meth:`truncate` drops a refused one).
    Then it joins the free queue's tail: it stays findable until the LRU queue hands it out
    again, as a slot or a checkpoint (free entries and evictable checkpoints are one budget).
    Of the generated tokens' checkpoints, every ``decode_checkpoint_interval``-th block's stays
    (0: none), the others only until the request's next one replaces them, so the pool holds
    one per conversation beside the grid (-1: none are taken). A freed slot joins the head: it
    holds no checkpoint. A hit starts the request from a copy of the checkpoint in its slot. A
    save is skipped when no entry is free: checkpoints never make a step wait.
    """

    def __init__(
        self,
        spec: RecurrentStateSpec,
        num_blocks: int,
        enable_prefix_caching: bool = False,
        chain_block_size: int = 1,
        decode_checkpoint_interval: int = 0,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (slot 0 is reserved), got {num_blocks}")
        if decode_checkpoint_interval < -1:
            raise ValueError(
                f"decode_checkpoint_interval must be >= -1, got {decode_checkpoint_interval}"
            )
        self.spec = spec
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.chain_block_size = chain_block_size
        self.decode_checkpoint_interval = decode_checkpoint_interval
        self._keeps_generated = decode_checkpoint_interval >= 0
        self._pool = BlockPool(num_blocks)
        self._requests: dict[str, _RequestSlot] = {}
        self._tables: dict[str, list[int]] = {}  # request -> [its slot]
        # This pass's copies: (checkpoint, slot) before the step, (slot, checkpoint) after it,
        # (request, position, checkpoint) after its verification, and the hash each saved
        # checkpoint of known tokens is registered under once the pass is sealed.
        self._restores: list[tuple[int, int]] = []
        self._saves: list[tuple[int, int]] = []
        self._verified: list[tuple[str, int, int]] = []
        self._pending: dict[int, int] = {}  # checkpoint -> hash
        self._keeps: list[tuple[int, int]] = []  # (slot, kept) after the step
        self._confirmed: list[tuple[int, int]] = []  # this pass's (checkpoint, hash)
        # Checkpoints that are some request's latest of generated tokens (its ``latest``).
        self._latest: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free

    def describe_pool(self) -> str:
        if not self.enable_prefix_caching:
            return f"{self.num_blocks - 1} state slots"
        n = self.decode_checkpoint_interval
        generated = (
            ""
            if n < 0
            else f"; of generated tokens {f'every {n} blocks and ' if n else ''}"
            "each request's latest"
        )
        return (
            f"{self.num_blocks - 1} entries of state slots (one per running request) and "
            f"checkpoints of cached prefixes (where prefill chunks end on a block{generated}), "
            "checkpoints evicted least recently used first"
        )

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
        """The last checkpoint boundary of the known tokens in ``(start, end)``, else ``end``:
        a prefill chunk (or a preempted request's recomputation) cut there leaves a state to
        save, for later prompts sharing it."""
        keep = request.keep_state_at
        if start < keep < end:
            end = keep
        if not self.enable_prefix_caching:
            return end
        bs = self.chain_block_size
        known = len(request.all_token_ids) if self._keeps_generated else request.num_prompt_tokens
        boundary = min(end, known) // bs * bs
        return boundary if start < boundary < end else end

    def plan(self, request: CachedSequence, num_new_tokens: int, hits: Sequence[int]) -> SlotPlan:
        state = self._requests.get(request.request_id)
        keeps = self._keeps_now(request, state, num_new_tokens, hits)
        return SlotPlan((state is None) + keeps)

    def _keeps_now(
        self,
        request: CachedSequence,
        state: _RequestSlot | None,
        num_new_tokens: int,
        hits: Sequence[int],
    ) -> bool:
        """Whether this step starts or ends at the request's ``keep_state_at`` with no entry
        keeping that state yet."""
        keep = request.keep_state_at
        if not keep or (state is not None and state.kept != NULL_SLOT):
            return False
        start = request.num_computed_tokens + len(hits) * self.chain_block_size
        return keep in (start, start + num_new_tokens)

    def commit(
        self,
        request: CachedSequence,
        num_new_tokens: int,
        hits: Sequence[int],
        plan: SlotPlan,
        chain: Sequence[int] = (),
    ) -> None:
        state = self._requests.get(request.request_id)
        keeps = self._keeps_now(request, state, num_new_tokens, hits)
        if state is None:
            state = self._take_slot(request, hits)
        if keeps:
            self._keep(request, state, hits)
        if not self.enable_prefix_caching:
            return
        if state.unconfirmed:
            self._confirm(state, chain)
        bs = self.chain_block_size
        start = request.num_computed_tokens + len(hits) * bs
        end = start + num_new_tokens
        if end > request.num_tokens:  # a verification step: its proposals after the tokens
            boundaries = range(start // bs * bs + bs, end + 1, bs)
        else:  # inside a chunk only its end (chunk_end cuts chunks at the boundary to keep)
            boundaries = range(end, end + 1) if end % bs == 0 else range(0)
        for boundary in boundaries:
            generated = boundary > request.num_prompt_tokens
            if generated and not self._keeps_generated:
                break
            if generated and boundary != boundaries[-1] and not self._on_grid(boundary):
                continue  # (a verification across several: the grid's and its last)
            checkpoint = self._save(request, state, boundary, start, end, chain)
            if generated and checkpoint is not None:
                # the request's newest checkpoint of generated tokens replaces its latest
                if state.latest is not None:
                    self._drop(state, *state.latest, chain)
                state.latest = None if self._on_grid(boundary) else (boundary, checkpoint)
                if state.latest is not None:
                    self._latest.add(checkpoint)
        state.next_checkpoint = (end // bs + 1) * bs

    def _keep(self, request: CachedSequence, state: _RequestSlot, hits: Sequence[int]) -> None:
        """Take the entry keeping the state after ``keep_state_at`` tokens: copied from the
        slot after a step ending there, or before a step starting there, from the entry the
        state is in then (the hit's checkpoint, or the slot it became)."""
        taken: list[int] = []
        self._take(taken)
        state.kept = taken[0]
        if request.num_computed_tokens + len(hits) * self.chain_block_size == request.keep_state_at:
            self._restores.append((hits[-1] if hits else state.slot, state.kept))
        else:
            self._keeps.append((state.slot, state.kept))

    def _on_grid(self, boundary: int) -> bool:
        """Whether a checkpoint of generated tokens at ``boundary`` stays when the next comes."""
        n = self.decode_checkpoint_interval
        return n > 0 and boundary // self.chain_block_size % n == 0

    def _save(
        self,
        request: CachedSequence,
        state: _RequestSlot,
        boundary: int,
        start: int,
        end: int,
        chain: Sequence[int],
    ) -> int | None:
        """Take an entry for the state after ``boundary`` tokens, saved from the slot after the
        step (``boundary == end``) or from the verification's row, and registered at the seal
        where its hash is known, else held as unconfirmed; None (nothing taken) when no entry
        is free or the prefix is cached already."""
        pool = self._pool
        index = boundary // self.chain_block_size
        known = index <= len(chain)
        if not pool.num_free or (
            known
            and (chain[index - 1] in pool.cached or chain[index - 1] in self._pending.values())
        ):
            return None
        taken: list[int] = []
        self._take(taken)
        checkpoint = taken[0]
        if boundary == end:
            self._saves.append((state.slot, checkpoint))
        else:
            self._verified.append((request.request_id, boundary - start - 1, checkpoint))
        if known:
            self._pending[checkpoint] = chain[index - 1]
        else:
            state.unconfirmed.append((boundary, checkpoint))
        return checkpoint

    def _drop(
        self, state: _RequestSlot, boundary: int, checkpoint: int, chain: Sequence[int] = ()
    ) -> None:
        """Give back a checkpoint of an earlier pass: the request's unconfirmed one, or one
        registered under ``chain``'s hash, if still so and free (the LRU queue may have handed
        it out since)."""
        pool = self._pool
        self._latest.discard(checkpoint)
        if (boundary, checkpoint) in state.unconfirmed:
            state.unconfirmed.remove((boundary, checkpoint))
            pool.release_to_head([checkpoint])
            return
        index = boundary // self.chain_block_size
        if (
            index <= len(chain)
            and pool.block_hash[checkpoint] == chain[index - 1]
            and pool.ref_cnt[checkpoint] == 0
        ):
            pool.discard(checkpoint)

    def _confirm(self, state: _RequestSlot, chain: Sequence[int]) -> None:
        """Unconfirmed checkpoints whose hash ``chain`` now has (their tokens known, so
        accepted) become findable; their saves ran in earlier steps."""
        pool, bs = self._pool, self.chain_block_size
        waiting = []
        for boundary, checkpoint in state.unconfirmed:
            if boundary // bs > len(chain):
                waiting.append((boundary, checkpoint))
                continue
            block_hash = chain[boundary // bs - 1]
            if block_hash in pool.cached:  # (the same tokens saved since)
                self._latest.discard(checkpoint)
                pool.release_to_head([checkpoint])
            else:
                pool.register(checkpoint, block_hash)
                pool.release([checkpoint])
                self._confirmed.append((checkpoint, block_hash))
        state.unconfirmed = waiting

    def _take_slot(self, request: CachedSequence, hits: Sequence[int]) -> _RequestSlot:
        """The request's slot, filled from its hit's checkpoint (``hits[-1]``) before its first
        step. A request's latest checkpoint of generated tokens (what its conversation's next
        turn resumes from: the prefix of no one else) becomes the slot itself, its state
        already in place, where the new prompt reaches the next boundary (its prefill leaves a
        checkpoint there), and so does any checkpoint that is the last free entry; another is
        kept from being handed out as the slot and moves to the queue's tail (the most
        recently used). So a turn takes no entry beside the one its previous turn left."""
        pool = self._pool
        checkpoint = hits[-1] if hits else None
        passes = len(request.all_token_ids) >= (len(hits) + 1) * self.chain_block_size
        consume = checkpoint is not None and (
            (checkpoint in self._latest and passes) or pool.num_free == 1
        )
        table: list[int] = []
        if checkpoint is not None:
            pool.touch([checkpoint])
        if consume:
            pool.uncache(checkpoint)
            self._latest.discard(checkpoint)
            table.append(checkpoint)
        else:
            self._take(table)
        state = self._requests[request.request_id] = _RequestSlot(
            table[0], sys.maxsize, keep_at=request.keep_state_at
        )
        self._tables[request.request_id] = table
        if checkpoint is not None and not consume:
            self._restores.append((checkpoint, state.slot))
            pool.release([checkpoint])
        return state

    def _take(self, out: list[int]) -> None:
        """One entry from the free queue's head (evicting the checkpoint it may hold)."""
        self._pool.take(1, out)
        self._latest.discard(out[-1])

    def take_state_copies(self) -> StateCopies:
        """This pass's restores and saves; seals the pass: its checkpoints of known tokens
        become findable."""
        pool = self._pool
        registered = []
        for checkpoint, block_hash in self._pending.items():
            pool.register(checkpoint, block_hash)
            if pool.block_hash[checkpoint] == block_hash:
                registered.append((checkpoint, block_hash))
        pool.release(self._pending)
        copies = StateCopies(
            self._restores,
            self._saves + self._keeps,
            self._verified,
            registered,
            self._confirmed,
        )
        self._restores, self._saves, self._verified, self._keeps = [], [], [], []
        self._confirmed, self._pending = [], {}
        return copies

    def headroom(self, request_id: str) -> AllocationHeadroom:
        """A step needs nothing until it ends at the request's next checkpoint."""
        state = self._requests.get(request_id)
        if state is None:
            return NO_HEADROOM
        end = state.next_checkpoint
        if state.kept == NULL_SLOT and state.keep_at:
            end = min(end, state.keep_at)
        return AllocationHeadroom(end - 1, sys.maxsize)

    def truncate(self, request: CachedSequence, num_tokens: int) -> None:
        """The slot stays (the runner puts back the state the accepted tokens left); the
        checkpoints planned past ``num_tokens`` (refused proposals) are dropped."""
        state = self._requests.get(request.request_id)
        if state is None or not state.unconfirmed:
            return
        refused = [c for c in state.unconfirmed if c[0] > num_tokens]
        for boundary, checkpoint in refused:
            self._drop(state, boundary, checkpoint)
        if state.latest in refused:
            state.latest = None

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def transfer_table(self, request_id: str) -> list[int]:
        """The entry keeping the state after the request's ``keep_state_at`` tokens, if any."""
        state = self._requests.get(request_id)
        return [] if state is None or state.kept == NULL_SLOT else [state.kept]

    def block_hashes(self, request_id: str) -> Sequence[int]:
        return ()

    def request_ids(self) -> Collection[str]:
        return self._requests.keys()

    def free(self, request: CachedSequence, chain: Sequence[int] = ()) -> None:
        """Checkpoints whose hash ``chain`` has stay findable; a save the request's step of
        this pass planned is dropped with its slot (freed in the same pass, the slot may serve
        another request before the step ends), and so are its unconfirmed ones."""
        state = self._requests.pop(request.request_id, None)
        if state is None:
            return
        del self._tables[request.request_id]
        if state.unconfirmed:
            self._confirm(state, chain)
        dropped = self._drop_saves(request.request_id, state.slot)
        held = {*dropped, *(c for _, c in state.unconfirmed)}
        self._latest -= held
        if state.kept != NULL_SLOT:  # (its copy of this pass, if any, goes with it)
            held.add(state.kept)
            self._keeps = [k for k in self._keeps if k[1] != state.kept]
            self._restores = [r for r in self._restores if r[1] != state.kept]
        # none of them a checkpoint anyone can find
        self._pool.release_to_head([state.slot, *held])

    def _drop_saves(self, request_id: str, slot: int) -> list[int]:
        """Drop the checkpoints this pass saves from the request's slot; returns them."""
        dropped = [c for s, c in self._saves if s == slot]
        dropped += [c for r, _, c in self._verified if r == request_id]
        if dropped:
            self._saves = [(s, c) for s, c in self._saves if s != slot]
            self._verified = [v for v in self._verified if v[0] != request_id]
            for checkpoint in dropped:
                self._pending.pop(checkpoint, None)
        return dropped

    def loads(self, request_id: str) -> None:
        """The slot's state arrives by a load (another instance's), not by this pass's
        step: nothing is copied into it or saved from it."""
        slot = self._requests[request_id].slot
        self._restores = [r for r in self._restores if r[1] != slot]
        self._pool.release_to_head(self._drop_saves(request_id, slot))

    def reset_prefix_cache(self) -> bool:
        if not self._pool.reset_hashes():
            return False
        self._latest.clear()
        return True

    def check_invariants(self) -> None:
        states = self._requests.values()
        if any(table != [s.slot] for table, s in zip(self._tables.values(), states)):
            raise RuntimeError("a request's table is other than its one slot")
        if self._tables.keys() != self._requests.keys():
            raise RuntimeError("slot tables kept for requests holding no slot")
        unconfirmed = [c for s in self._requests.values() for _, c in s.unconfirmed]
        kept = [s.kept for s in states if s.kept != NULL_SLOT]
        self._pool.check_invariants(
            [[s.slot] for s in states] + [list(self._pending), unconfirmed, kept]
        )
        if not self.enable_prefix_caching and (self._pool.cached or self._pending):
            raise RuntimeError("state checkpoints kept with prefix caching off")
        saved = [c for _, c in self._saves] + [c for _, _, c in self._verified]
        if (
            len(set(saved)) != len(saved)
            or not self._pending.keys() <= set(saved)
            or not set(saved) <= self._pending.keys() | set(unconfirmed)
        ):
            raise RuntimeError("this pass's saves and the checkpoints they fill disagree")
        registered = {b for b in self._latest if self._pool.block_hash[b] is not None}
        if not self._latest <= registered | self._pending.keys() | set(unconfirmed):
            raise RuntimeError("a latest checkpoint that is neither cached nor being saved")
