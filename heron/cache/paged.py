"""The paged cache kind (full attention, a sliding window or MLA's latent): its specs, and the
manager of a paged group: per-request block tables over one
:class:`~heron.cache.block_pool.BlockPool`, prefix caching of full blocks."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from heron.cache.block_pool import NULL_BLOCK_ID, BlockPool, hash_block_tokens
from heron.cache.manager import (
    NO_HEADROOM,
    AllocationHeadroom,
    CachedSequence,
    CacheManager,
    refuse_late_hits,
)
from heron.cache.paged_parts import PagedStepParts
from heron.cache.spec import CacheSpec

if TYPE_CHECKING:
    from heron.metadata.parts import StepParts


def paged_table_width(max_model_len: int, block_size: int, sliding_window: int | None) -> int:
    """Widest table row a decode step reads: every block of the context, or with a window the
    blocks from the window's first key to the newest token."""
    width = -(-max_model_len // block_size)
    if sliding_window is None:
        return width
    return min(width, -(-(sliding_window - 1) // block_size) + 1)


@dataclass(frozen=True)
class PagedSpec(CacheSpec):
    """A kind whose every token keeps its entry in paged blocks for the whole sequence, served
    by the paged manager (prefix caching included); subclasses give the entry's shape."""

    # The axis of a cache tensor that indexes blocks (what a KV connector copies along).
    block_axis = 0

    def blocks_per_seq(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        return -(-max_model_len // self.block_size)

    def first_table_block(self, context: int | np.ndarray) -> int | np.ndarray:
        """Index, in a request's table, of the first block a step at ``context`` reads."""
        return 0

    def step_parts(self) -> StepParts:
        return PagedStepParts(self)

    def make_manager(
        self,
        num_blocks: int,
        enable_prefix_caching: bool,
        chain_block_size: int,
        decode_checkpoint_interval: int,
    ) -> CacheManager:
        return PagedCacheManager(self, num_blocks, enable_prefix_caching)


@dataclass(frozen=True)
class FullAttentionSpec(PagedSpec):
    """Paged K and V of every token: ``[2, blocks, block_size, kv_heads, head_dim]``."""

    num_kv_heads: int
    head_dim: int

    block_axis = 1

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self._element_size()

    def tensor_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def describe(self) -> str:
        return (
            f"full attention: {self.block_size}-token blocks, {self.num_kv_heads} KV heads of "
            f"{self.head_dim}, {str(self.dtype).removeprefix('torch.')}"
        )


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """Paged K and V of the last ``sliding_window`` tokens; older blocks are released.

    A query at position ``p`` sees keys ``j`` with ``p - sliding_window < j <= p``.
    """

    sliding_window: int

    def __post_init__(self) -> None:
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")

    def blocks_per_seq(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        # A step of n tokens keeps keys from W before its first one (one more than it reads).
        live = -(-(self.sliding_window + max_num_batched_tokens) // self.block_size) + 1
        return min(super().blocks_per_seq(max_model_len, max_num_batched_tokens), live)

    def first_table_block(self, context: int | np.ndarray) -> int | np.ndarray:
        """The block of the first key that a token at position ``context`` sees: the one rule
        by which a windowed row starts at the window (and, at ``context - 1``, the first block
        a step keeps: the key before the first one it reads)."""
        if isinstance(context, int):  # the managers' per-request calls: no numpy dispatch
            return max(context - self.sliding_window + 1, 0) // self.block_size
        return np.maximum(context - self.sliding_window + 1, 0) // self.block_size

    def describe(self) -> str:
        return f"sliding window {self.sliding_window}, " + super().describe()


@dataclass(frozen=True)
class LatentAttentionSpec(PagedSpec):
    """Paged multi-head latent attention (DeepSeek's MLA): per token one entry of the
    compressed KV latent and the shared rotary key, ``[blocks, block_size, kv_lora_rank +
    rope_dim]``. Every query head reads the same entry, so it is one "KV head" wide; blocks are
    paged and prefix-cached as full attention's are."""

    kv_lora_rank: int
    rope_dim: int

    @property
    def entry_size(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.entry_size * self._element_size()

    def tensor_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.block_size, self.entry_size)

    def describe(self) -> str:
        return (
            f"latent attention: {self.block_size}-token blocks, latent {self.kv_lora_rank} + "
            f"rope {self.rope_dim}, {str(self.dtype).removeprefix('torch.')}"
        )


@dataclass(slots=True)
class _RequestBlocks:
    """What the manager keeps per request between steps."""

    block_ids: list[int] = field(default_factory=list)
    # Chain hashes of the request's first len(block_hashes) full blocks: those already offered for
    # registration. Kept so each step hashes only the blocks that became full since the last one.
    block_hashes: list[int] = field(default_factory=list)
    # Leading blocks that came from the prefix cache: valid content even before any step runs.
    num_hit_blocks: int = 0
    # Leading table entries released because they slid out of the window (now the null block).
    num_released: int = 0


class PagedPlan(NamedTuple):
    """A step's allocation in a paged group."""

    num_new: int  # blocks to take from the free queue
    first_live: int  # table index of the first block the step keeps
    num_needed: int  # net blocks: new + hits taken off the free queue - blocks released


class PagedCacheManager(CacheManager):
    """Allocates a paged group's blocks to requests and shares full blocks between them by
    content.

    A step covers ``request.num_computed_tokens + len(hits) * block_size + num_new_tokens``
    tokens; hits head the table and gain a reference. Every full block whose tokens are all
    known is registered at allocation time, as soon as the step that will write it is scheduled
    (a request scheduled in the same step may hit it: every layer writes the step's KV before
    its attention reads it). If the request is then freed before those tokens are computed
    (``request.num_computed_tokens`` not advanced past them, e.g. preempted in the same
    scheduling pass), :meth:`free` drops those registrations, since the blocks were never
    written.

    With a sliding window, a step first releases every block before the one its first token's
    key before the window lies in (``spec.first_table_block(c - 1)``, ``c`` the step's first
    position): its table entry becomes the null block and its reference is dropped (it joins
    the free queue, still findable by hash until evicted); hit blocks below it are not taken at
    all. Only then are the step's new blocks taken, so the released ones are reusable at once.
    Keeping the one key before the window costs nothing and, when the window is a multiple of
    the block size, makes a decode step release a block in the step that takes the next one:
    one slow step per block instead of two.

    Blocks are keyed by a 64-bit chained hash (:func:`hash_block_tokens`) and a hit is not
    checked against the tokens, so two different prefixes with equal hashes would share KV.
    By chance that is negligible (about n^2 / 2^65 for n cached blocks); but the built-in hash is
    not collision-resistant, so a client who can craft prompts could aim at another client's
    prefix. A multi-tenant deployment wants a cryptographic hash (e.g. SHA-256 of the parent
    digest and token bytes) in :func:`hash_block_tokens`.
    """

    def __init__(
        self, spec: CacheSpec, num_blocks: int, enable_prefix_caching: bool = True
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        if spec.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {spec.block_size}")
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = spec.block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
        self._pool = BlockPool(num_blocks)
        self._requests: dict[str, _RequestBlocks] = {}

    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free

    def find_cached_chain(
        self, request: CachedSequence, hashes: list[int] | None = None
    ) -> list[int]:
        """The whole chain must be present, also in a sliding-window group (blocks freed because
        they slid out of a window stay cached until evicted, and count)."""
        num_tokens = len(request.all_token_ids)
        tokens = request.all_token_ids
        bs = self.block_size
        cached = self._pool.cached
        block_ids: list[int] = []
        parent = request.prefix_root
        for i, start in enumerate(range(0, (num_tokens - 1) // bs * bs, bs)):
            if hashes is not None and i < len(hashes):
                parent = hashes[i]
            else:
                parent = hash_block_tokens(
                    parent, tokens[start : start + bs], request.block_extras(start, start + bs)
                )
                if hashes is not None:
                    hashes.append(parent)
            block_id = cached.get(parent)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def check_hits(self, request: CachedSequence, hits: Sequence[int]) -> None:
        if hits:
            refuse_late_hits(request, self._requests, self._pool, hits, "a computed block")

    def plan(self, request: CachedSequence, num_new_tokens: int, hits: Sequence[int]) -> PagedPlan:
        """Hits on blocks in the free queue count as needed (taking them makes them
        unallocatable); blocks released because they slid out of the window count as freed."""
        state = self._requests.get(request.request_id)
        num_hit = len(hits)
        bs = self.block_size
        num_covered = request.num_computed_tokens + num_hit * bs + num_new_tokens
        num_held = num_hit + (len(state.block_ids) if state is not None else 0)
        num_new = max(0, -(-num_covered // bs) - num_held)
        if self._window is None:  # the common case, kept cheap: it runs every slow step
            return PagedPlan(num_new, 0, num_new + (self._num_evictable(hits) if num_hit else 0))
        first_needed = request.num_computed_tokens + num_hit * bs
        first_live = int(self.spec.first_table_block(first_needed - 1))
        needed = (
            num_new + self._num_evictable(hits[first_live:]) - self._num_released(state, first_live)
        )
        return PagedPlan(num_new, first_live, needed)

    def commit(
        self,
        request: CachedSequence,
        num_new_tokens: int,
        hits: Sequence[int],
        plan: PagedPlan,
        chain: Sequence[int] = (),
    ) -> None:
        pool = self._pool
        num_new, first_live, _ = plan
        num_hit = len(hits)
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _RequestBlocks()
        if num_hit:
            live_hits = hits[first_live:]
            pool.touch(live_hits)
            state.block_ids.extend([NULL_BLOCK_ID] * (num_hit - len(live_hits)))
            state.block_ids.extend(live_hits)
            state.num_released = num_hit - len(live_hits)
            state.num_hit_blocks = num_hit
            if self.enable_prefix_caching:
                # Hit blocks are registered, so their chain hashes are stored: no rehashing.
                state.block_hashes.extend(pool.block_hash[b] for b in hits)
        elif first_live > state.num_released:
            self._release_slid_out(state, first_live)
        if num_new:
            pool.take(num_new, state.block_ids)

        if self.enable_prefix_caching:
            num_covered = request.num_computed_tokens + num_hit * self.block_size + num_new_tokens
            # Only blocks of known tokens can be hashed (not those holding a pending token).
            num_full = min(num_covered, len(request.all_token_ids)) // self.block_size
            if num_full > len(state.block_hashes):
                self._register_full_blocks(request, state, num_full, chain)

    def headroom(self, request_id: str) -> AllocationHeadroom:
        """Conservative (a smaller headroom only sends a step down the full path, which is
        always right): a step covering ``t`` tokens, ``k`` of them known, needs nothing when
        ``t`` fits in the table, no full block of known tokens is left to register (``k // bs``
        hashes), and, with a window, no held block lies before ``first_table_block(c - 1)``,
        ``c`` its first token (at most ``t - 1``). Counting only known tokens keeps the step
        that fills a block with a token still being sampled within the headroom: the block is
        registered one step later, with the next block's allocation.
        """
        state = self._requests.get(request_id)
        if state is None:
            return NO_HEADROOM
        bs = self.block_size
        tokens = len(state.block_ids) * bs
        if self._window is not None:
            # The largest t whose c = t - 1 has first_table_block(c - 1) <= num_released.
            tokens = min(tokens, (state.num_released + 1) * bs + self._window)
        if not self.enable_prefix_caching:
            return AllocationHeadroom(tokens, tokens)
        return AllocationHeadroom(tokens, (len(state.block_hashes) + 1) * bs - 1)

    def block_hashes(self, request_id: str) -> list[int]:
        state = self._requests.get(request_id)
        return state.block_hashes if state is not None else []

    def block_table(self, request_id: str) -> list[int]:
        state = self._requests.get(request_id)
        return state.block_ids if state is not None else []

    def request_ids(self) -> Collection[str]:
        return self._requests.keys()

    def free(self, request: CachedSequence, chain: Sequence[int] = ()) -> None:
        """Blocks reaching ref 0 join the free queue tail in reverse table order, so a
        sequence's tail blocks are evicted before its head (a later hit needs the head).
        Registered blocks stay findable until evicted, except blocks past
        ``request.num_computed_tokens`` (and past the prefix hits): those were registered for a
        step that never ran, so hold no valid KV. Full computed blocks whose last token was
        still being sampled at their step are registered now. Call this after advancing
        ``num_computed_tokens`` for the last step, or the blocks that step filled are not kept
        in the cache.
        """
        state = self._requests.pop(request.request_id, None)
        if state is None:
            return
        pool = self._pool
        num_computed = min(request.num_computed_tokens, len(request.all_token_ids))
        if self.enable_prefix_caching and num_computed // self.block_size > len(state.block_hashes):
            self._register_full_blocks(request, state, num_computed // self.block_size, chain)
        num_valid_blocks = max(request.num_computed_tokens // self.block_size, state.num_hit_blocks)
        # Blocks at or past num_valid_blocks were allocated by this request, so any hash they
        # carry is its own registration.
        for i in range(num_valid_blocks, len(state.block_hashes)):
            if state.block_ids[i] != NULL_BLOCK_ID:
                pool.uncache(state.block_ids[i])
        pool.release(reversed(state.block_ids[state.num_released :]))

    def truncate(self, request: CachedSequence, num_tokens: int) -> None:
        """Blocks past the one holding token ``num_tokens - 1`` go to the free queue's head:
        they were taken for refused proposals, so they hold nothing anyone looks up (a block
        is registered only once its tokens are known, which refused ones never were)."""
        state = self._requests.get(request.request_id)
        if state is None:
            return
        keep = max(-(-num_tokens // self.block_size), state.num_released, state.num_hit_blocks)
        if len(state.block_hashes) > keep:
            raise RuntimeError(
                f"request {request.request_id}: truncating to {num_tokens} tokens would drop "
                "registered blocks"
            )
        dropped = state.block_ids[keep:]
        del state.block_ids[keep:]
        self._pool.release_to_head(reversed(dropped))

    def reset_prefix_cache(self) -> bool:
        return self._pool.reset_hashes()

    def check_invariants(self) -> None:
        self._pool.check_invariants(s.block_ids[s.num_released :] for s in self._requests.values())
        for request_id, state in self._requests.items():
            if any(b != NULL_BLOCK_ID for b in state.block_ids[: state.num_released]):
                raise RuntimeError(f"request {request_id} holds a released block")
            if self._window is None and state.num_released:
                raise RuntimeError(f"request {request_id} released blocks without a window")
            if len(state.block_hashes) > len(state.block_ids):
                raise RuntimeError(f"request {request_id} has hashes for blocks it does not hold")
            if state.num_hit_blocks > len(state.block_ids):
                raise RuntimeError(f"request {request_id} has more hit blocks than blocks")

    def _num_released(self, state: _RequestBlocks | None, first_live: int) -> int:
        """How many blocks :meth:`_release_slid_out` would return to the free queue."""
        if state is None:
            return 0
        ref_cnt = self._pool.ref_cnt
        return sum(1 for b in state.block_ids[state.num_released : first_live] if ref_cnt[b] == 1)

    def _release_slid_out(self, state: _RequestBlocks, first_live: int) -> None:
        """Null the table entries before ``first_live`` and drop their references."""
        block_ids = state.block_ids
        released = block_ids[state.num_released : first_live]
        block_ids[state.num_released : first_live] = [NULL_BLOCK_ID] * len(released)
        state.num_released = first_live
        self._pool.release(reversed(released))

    def _num_evictable(self, block_ids: Sequence[int]) -> int:
        """How many of ``block_ids`` sit in the free queue (ref count 0)."""
        ref_cnt = self._pool.ref_cnt
        return sum(1 for b in block_ids if ref_cnt[b] == 0)

    def _register_full_blocks(
        self, request: CachedSequence, state: _RequestBlocks, num_full: int, chain: Sequence[int]
    ) -> None:
        """Hash and register the request's full blocks ``len(state.block_hashes)..num_full-1``,
        taking the hashes ``chain`` already has."""
        bs = self.block_size
        tokens = request.all_token_ids
        hashes = state.block_hashes
        parent = hashes[-1] if hashes else request.prefix_root
        for i in range(len(hashes), num_full):
            if i < len(chain):
                parent = chain[i]
            else:
                start = i * bs
                extras = request.block_extras(start, start + bs)
                parent = hash_block_tokens(parent, tokens[start : start + bs], extras)
            hashes.append(parent)
            if state.block_ids[i] != NULL_BLOCK_ID:
                self._pool.register(state.block_ids[i], parent)
