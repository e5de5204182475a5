"""Paged KV-cache blocks: who holds which block, and prefix caching of full blocks.

The KV cache is split into ``num_blocks`` blocks of ``block_size`` token slots. Each request owns a
block table (the blocks holding its tokens, in order). A block whose tokens are all known is
*registered* under a hash of its content and of everything before it, so a later request whose
prompt starts with the same tokens can reuse the block instead of recomputing it.

Three classes split the work:

- :class:`BlockPool` owns the blocks themselves: reference counts, the free queue (LRU order) and
  the hash -> block map. It knows nothing about requests.
- :class:`KVCacheManager` owns one cache group's per-request block tables and hash chains, and
  decides what to allocate, register and free. A sliding-window group releases the blocks that
  slid out of the window (their table entries become the null block).
- :class:`KVCacheCoordinator` manages one :class:`KVCacheManager` per *cache group*: layers with
  the same KV retention (full history, or a sliding window of ``W`` tokens) share a group; each
  group has its own pool (block 0 reserved in each) and its own tables. Allocation is atomic
  across groups, and a cached prefix is reused only as far as every group has it.

A block with reference count 0 sits in the free queue whether or not it is registered; a
registered one stays findable by hash (and can be revived by a hit) until it reaches the head of
the queue and is handed out again, which is when its hash entry is dropped (eviction).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from heron.engine.request import Request

NULL_BLOCK_ID = 0
"""Never handed out: padded rows of a batch point their block tables at it."""

# Parent hash of each sequence's first block. Any fixed int does; it only has to agree between
# processes sharing hashes, and int/tuple hashes (unlike str) are not salted by PYTHONHASHSEED.
_ROOT_HASH = 0x6865726F6E


def hash_block_tokens(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Hash of a full block, chained to the hash of the block before it.

    Python's built-in 64-bit tuple hash: about 0.15 µs for a 16-token block, and deterministic
    across processes. See :class:`KVCacheManager` for what a collision costs.
    """
    return hash((parent_hash, tuple(token_ids)))


class BlockPool:
    """Blocks ``1..num_blocks-1``: reference counts, an LRU free queue and the hash -> block map.

    The free queue is an ``OrderedDict`` keyed by block id: O(1) pop at the head (allocation),
    append at the tail (free) and removal from the middle (a cached free block that gets a hit).
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        # The hash a block is registered under, or None; block_hash[b] == h <=> cached[h] == b.
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))

    @property
    def num_free(self) -> int:
        """Blocks with no holder, registered (evictable) or not."""
        return len(self.free_queue)

    def take(self, n: int, out: list[int]) -> None:
        """Move ``n`` blocks from the head of the free queue to the end of ``out``, with ref 1.

        The caller checks ``n <= num_free`` first. A registered block handed out is evicted: its
        hash entry goes, since its content is about to be overwritten.
        """
        free_queue, ref_cnt, block_hash = self.free_queue, self.ref_cnt, self.block_hash
        for _ in range(n):
            block_id, _ = free_queue.popitem(last=False)
            h = block_hash[block_id]
            if h is not None:
                del self.cached[h]
                block_hash[block_id] = None
            ref_cnt[block_id] = 1
            out.append(block_id)

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block (prefix hits), pulling free ones off the queue."""
        free_queue, ref_cnt = self.free_queue, self.ref_cnt
        for block_id in block_ids:
            if ref_cnt[block_id] == 0:
                del free_queue[block_id]
            ref_cnt[block_id] += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block; those reaching 0 join the queue tail in this order."""
        free_queue, ref_cnt = self.free_queue, self.ref_cnt
        for block_id in block_ids:
            ref_cnt[block_id] -= 1
            if ref_cnt[block_id] == 0:
                free_queue[block_id] = None

    def register(self, block_id: int, block_hash: int) -> None:
        """Make ``block_id`` findable under ``block_hash`` unless another block already is.

        Keeping the existing entry (no dedupe) means the duplicate just stays unregistered and is
        reused as an ordinary block once freed.
        """
        if block_hash not in self.cached:
            self.cached[block_hash] = block_id
            self.block_hash[block_id] = block_hash

    def uncache(self, block_id: int) -> None:
        """Drop ``block_id``'s hash entry, if it has one."""
        h = self.block_hash[block_id]
        if h is not None:
            del self.cached[h]
            self.block_hash[block_id] = None

    def reset_hashes(self) -> None:
        """Forget every hash entry (blocks stay where they are)."""
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks

    def check_invariants(self, tables: Iterable[Sequence[int]]) -> None:
        """Raise ``RuntimeError`` unless refs, free queue and hash map agree with ``tables``."""
        holders = [0] * self.num_blocks
        for table in tables:
            if len(set(table)) != len(table):
                raise RuntimeError(f"block table holds a block twice: {table}")
            for block_id in table:
                if not NULL_BLOCK_ID < block_id < self.num_blocks:
                    raise RuntimeError(f"block table holds invalid block {block_id}: {table}")
                holders[block_id] += 1
        if holders != self.ref_cnt:
            bad = [b for b in range(self.num_blocks) if holders[b] != self.ref_cnt[b]]
            raise RuntimeError(
                "ref counts disagree with block tables at blocks "
                f"{bad[:10]}: ref={[self.ref_cnt[b] for b in bad[:10]]} "
                f"holders={[holders[b] for b in bad[:10]]}"
            )
        free = {b for b in range(1, self.num_blocks) if self.ref_cnt[b] == 0}
        if len(self.free_queue) != len(free) or set(self.free_queue) != free:
            raise RuntimeError("free queue does not hold exactly the blocks with ref count 0")
        if self.block_hash[NULL_BLOCK_ID] is not None:
            raise RuntimeError("the null block is registered in the prefix cache")
        for h, block_id in self.cached.items():
            if self.block_hash[block_id] != h:
                raise RuntimeError(
                    f"hash entry {h} -> block {block_id}, whose stored hash is "
                    f"{self.block_hash[block_id]}"
                )
        if sum(h is not None for h in self.block_hash) != len(self.cached):
            raise RuntimeError("a block has a stored hash but no hash entry points at it")


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


class KVCacheManager:
    """Allocates KV blocks to requests and shares full blocks between them by content.

    Blocks are registered at allocation time, as soon as the step that will write them is
    scheduled (a request scheduled in the same step may hit them: every layer writes the step's KV
    before its attention reads it). If the request is then freed before those tokens are computed
    (``request.num_computed_tokens`` not advanced past them, e.g. preempted in the same scheduling
    pass), :meth:`free` drops those registrations, since the blocks were never written.

    Blocks are keyed by a 64-bit chained hash (:func:`hash_block_tokens`) and a hit is not
    checked against the tokens, so two different prefixes with equal hashes would share KV.
    By chance that is negligible (about n^2 / 2^65 for n cached blocks); but the built-in hash is
    not collision-resistant, so a client who can craft prompts could aim at another client's
    prefix. A multi-tenant deployment wants a cryptographic hash (e.g. SHA-256 of the parent
    digest and token bytes, about 0.8 µs per block) in :func:`hash_block_tokens`.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        sliding_window: int | None = None,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.num_blocks = num_blocks
        self.sliding_window = sliding_window
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._pool = BlockPool(num_blocks)
        self._requests: dict[str, _RequestBlocks] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now: unheld ones, including cached blocks that would be evicted."""
        return self._pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks (all but the null block) held by requests."""
        num_usable = self.num_blocks - 1
        return (num_usable - self._pool.num_free) / num_usable

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest chain of cached full blocks that starts ``request.all_token_ids``.

        Only blocks lying entirely within the first ``num_tokens - 1`` tokens can hit, so at least
        one token is left to compute (the step needs logits for it). Returns the block ids and the
        number of tokens they hold, and takes no references: pass the ids to
        :meth:`allocate_slots` in the same scheduling pass, before anything can evict them.

        Returns ``([], 0)`` without counting a query when prefix caching is off or the request
        wants prompt logprobs (those need every prompt position computed).
        """
        if not self.enable_prefix_caching or request.wants_prompt_logprobs:
            return [], 0
        self.prefix_cache_queries += request.num_tokens
        block_ids = self.find_cached_chain(request)
        num_hit_tokens = len(block_ids) * self.block_size
        self.prefix_cache_hits += num_hit_tokens
        return block_ids, num_hit_tokens

    def find_cached_chain(self, request: Request, hashes: list[int] | None = None) -> list[int]:
        """The cached blocks heading ``request``'s first ``num_tokens - 1`` tokens (no counting).

        The whole chain must be present, also in a sliding-window group (blocks freed because
        they slid out of a window stay cached until evicted, and count). ``hashes``, when given,
        receives the chain hashes computed along the way (at least one per returned block), so
        other groups with the same block size need not rehash.
        """
        num_tokens = len(request.all_token_ids)
        tokens = request.all_token_ids
        bs = self.block_size
        cached = self._pool.cached
        block_ids: list[int] = []
        parent = _ROOT_HASH
        for i, start in enumerate(range(0, (num_tokens - 1) // bs * bs, bs)):
            if hashes is not None and i < len(hashes):
                parent = hashes[i]
            else:
                parent = hash_block_tokens(parent, tokens[start : start + bs])
                if hashes is not None:
                    hashes.append(parent)
            block_id = cached.get(parent)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def num_blocks_needed(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[int] = ()
    ) -> int:
        """By how much :meth:`allocate_slots` with these arguments would lower ``num_free_blocks``.

        That is the number of new blocks, plus any of ``new_computed_blocks`` taken out of the
        free queue (a hit on an evictable block takes it out of the allocatable pool too), minus
        the blocks that slid out of a sliding window and go back to the queue (so it can be
        negative). The call succeeds exactly when this is ``<= num_free_blocks``.
        """
        return self._plan(request, num_new_tokens, new_computed_blocks)[2]

    def _plan(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[int]
    ) -> tuple[int, int, int]:
        """(new blocks to take, first live table index, net blocks needed) for a step."""
        state = self._requests.get(request.request_id)
        num_hit = len(new_computed_blocks)
        num_new = self._num_new_blocks(state, request, num_new_tokens, num_hit)
        if self.sliding_window is None:  # the common case, kept cheap: it runs every step
            needed = num_new + (self._num_evictable(new_computed_blocks) if num_hit else 0)
            return num_new, 0, needed
        first_live = self._first_live_block(request, num_hit)
        needed = (
            num_new
            + self._num_evictable(new_computed_blocks[first_live:])
            - self._num_released(state, first_live)
        )
        return num_new, first_live, needed

    def check_computed_blocks(self, request: Request, new_computed_blocks: Sequence[int]) -> None:
        """Raise ``ValueError`` if hits are given past the request's first allocation, or a hit
        block was evicted since :meth:`get_computed_blocks`."""
        if not new_computed_blocks:
            return
        if request.request_id in self._requests:
            raise ValueError(
                f"request {request.request_id}: new_computed_blocks is only accepted on the "
                "first allocation"
            )
        if any(self._pool.block_hash[b] is None for b in new_computed_blocks):
            raise ValueError(
                f"request {request.request_id}: a computed block was evicted since "
                "get_computed_blocks; allocate in the same scheduling pass as the lookup"
            )

    def can_allocate(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[int] = ()
    ) -> bool:
        """Whether :meth:`allocate_slots` with these arguments would succeed (changes nothing)."""
        return self.num_blocks_needed(request, num_new_tokens, new_computed_blocks) <= (
            self._pool.num_free
        )

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[int] = ()
    ) -> bool:
        """Grow the request's block table to cover the tokens of this step.

        Covers ``request.num_computed_tokens + len(new_computed_blocks) * block_size +
        num_new_tokens`` tokens. ``new_computed_blocks`` (from :meth:`get_computed_blocks`, only
        on the request's first allocation) head the table and gain a reference. Then every full
        block whose tokens are all known is registered in the prefix cache.

        With a sliding window ``W``, the step computing positions ``[c, c + n)`` reads keys from
        ``c - W + 1`` on; first, every block whose tokens all lie below ``c - W`` is released: its
        table entry becomes the null block (the table keeps its positions) and its reference is
        dropped (it joins the free queue, still findable by hash until evicted). Hit blocks
        already below it are not taken at all. Only then are the step's new blocks taken, so the
        released ones are reusable at once. Keeping the one key before the window costs nothing
        and, when ``W`` is a multiple of the block size, makes a decode step release a block in
        the step that takes the next one (``c`` a multiple of the block size) rather than the
        step before: one slow step per block instead of two.

        Atomic: returns False, changing nothing, if there are not enough allocatable blocks.
        The caller advances ``request.num_computed_tokens`` after the step has run.
        """
        if not new_computed_blocks and self.is_quiet(request, num_new_tokens):
            return True
        self.check_computed_blocks(request, new_computed_blocks)
        plan = self._plan(request, num_new_tokens, new_computed_blocks)
        if plan[2] > self._pool.num_free:
            return False
        self._allocate(request, num_new_tokens, new_computed_blocks, plan)
        return True

    def quiet_limit(self, request_id: str) -> QuietLimit:
        """How far a step (``num_new_tokens >= 1``, no hits) may go while :meth:`allocate_slots`
        would change nothing: it may cover ``tokens`` tokens (``num_computed_tokens +
        num_new_tokens``), of which ``known`` may be known (in ``all_token_ids``: a decode
        step's input token is not while it is still being sampled). ``(-1, -1)`` for a request
        holding no blocks.

        Conservative (a smaller limit only sends a step down the full path, which is always
        right): a step covering ``t`` tokens, ``k`` of them known, needs nothing when ``t`` fits
        in the table, no full block of known tokens is left to register (``k // bs`` hashes),
        and, with a window ``W``, no held block lies wholly below ``c - W``, ``c`` its first
        token (at most ``t - 1``). Tables, hashes and releases only grow while a request holds
        blocks, so the limits only rise until :meth:`free`. Counting only known tokens keeps
        the step that fills a block with a token still being sampled on the quiet path: the
        block is registered one step later, with the next block's allocation.
        """
        state = self._requests.get(request_id)
        if state is None:
            return _NO_BLOCKS
        bs = self.block_size
        tokens = len(state.block_ids) * bs
        if self.sliding_window is not None:
            tokens = min(tokens, (state.num_released + 1) * bs + self.sliding_window)
        if not self.enable_prefix_caching:
            return QuietLimit(tokens, tokens)
        return QuietLimit(tokens, (len(state.block_hashes) + 1) * bs - 1)

    def is_quiet(self, request: Request, num_new_tokens: int) -> bool:
        """Whether a step of ``num_new_tokens`` (no hits) is within :meth:`quiet_limit`."""
        return _within(request, num_new_tokens, self.quiet_limit(request.request_id))

    def _allocate(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[int],
        plan: tuple[int, int, int],
        chain: Sequence[int] = (),
    ) -> None:
        """Carry out :meth:`allocate_slots` with its :meth:`_plan`, checked to fit the pool.
        ``chain``: the request's block hashes as far as another cache group has them (the
        same tokens and block size give the same chain), which are not computed again."""
        pool = self._pool
        num_new, first_live, _ = plan
        num_hit = len(new_computed_blocks)
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _RequestBlocks()
        if num_hit:
            live_hits = new_computed_blocks[first_live:]
            pool.touch(live_hits)
            state.block_ids.extend([NULL_BLOCK_ID] * (num_hit - len(live_hits)))
            state.block_ids.extend(live_hits)
            state.num_released = num_hit - len(live_hits)
            state.num_hit_blocks = num_hit
            if self.enable_prefix_caching:
                # Hit blocks are registered, so their chain hashes are stored: no rehashing.
                state.block_hashes.extend(pool.block_hash[b] for b in new_computed_blocks)
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

    def block_hashes(self, request_id: str) -> list[int]:
        """The request's registered chain of block hashes (the live list: read, don't mutate)."""
        state = self._requests.get(request_id)
        return state.block_hashes if state is not None else []

    def free(self, request: Request) -> None:
        """Drop the request's blocks (finished, aborted or preempted); unknown ids are a no-op.

        Blocks reaching ref 0 join the free queue tail in reverse table order, so a sequence's
        tail blocks are evicted before its head (a later hit needs the head). Registered blocks
        stay findable until evicted, except blocks past ``request.num_computed_tokens`` (and past
        the prefix hits): those were registered for a step that never ran, so hold no valid KV.
        Call this after advancing ``num_computed_tokens`` for the last step, or the blocks that
        step filled are not kept in the cache.
        """
        state = self._requests.pop(request.request_id, None)
        if state is None:
            return
        pool = self._pool
        num_valid_blocks = max(request.num_computed_tokens // self.block_size, state.num_hit_blocks)
        # Blocks at or past num_valid_blocks were allocated by this request, so any hash they
        # carry is its own registration.
        for i in range(num_valid_blocks, len(state.block_hashes)):
            if state.block_ids[i] != NULL_BLOCK_ID:
                pool.uncache(state.block_ids[i])
        pool.release(reversed(state.block_ids[state.num_released :]))

    def block_table(self, request_id: str) -> list[int]:
        """The request's block ids in token order (the live list: read, don't mutate)."""
        state = self._requests.get(request_id)
        return state.block_ids if state is not None else []

    def reset_prefix_cache(self) -> bool:
        """Forget all cached content; refused (False) while any request holds blocks."""
        if self._pool.num_free != self.num_blocks - 1:
            return False
        self._pool.reset_hashes()
        return True

    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` if pool and per-request state disagree (for tests/debugging)."""
        self._pool.check_invariants(s.block_ids[s.num_released :] for s in self._requests.values())
        for request_id, state in self._requests.items():
            if any(b != NULL_BLOCK_ID for b in state.block_ids[: state.num_released]):
                raise RuntimeError(f"request {request_id} holds a released block")
            if self.sliding_window is None and state.num_released:
                raise RuntimeError(f"request {request_id} released blocks without a window")
            if len(state.block_hashes) > len(state.block_ids):
                raise RuntimeError(f"request {request_id} has hashes for blocks it does not hold")
            if state.num_hit_blocks > len(state.block_ids):
                raise RuntimeError(f"request {request_id} has more hit blocks than blocks")

    def _num_new_blocks(
        self, state: _RequestBlocks | None, request: Request, num_new_tokens: int, num_hit: int
    ) -> int:
        """Blocks to take from the free queue so the table covers this step's tokens."""
        bs = self.block_size
        num_covered = request.num_computed_tokens + num_hit * bs + num_new_tokens
        num_held = num_hit + (len(state.block_ids) if state is not None else 0)
        return max(0, -(-num_covered // bs) - num_held)

    def _first_live_block(self, request: Request, num_hit: int) -> int:
        """Table index of the first block this step keeps: the block of the key just before the
        first one its queries can read (0 without a window; see :meth:`allocate_slots`)."""
        if self.sliding_window is None:
            return 0
        first_needed = request.num_computed_tokens + num_hit * self.block_size
        return max(0, first_needed - self.sliding_window) // self.block_size

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
        self, request: Request, state: _RequestBlocks, num_full: int, chain: Sequence[int]
    ) -> None:
        """Hash and register the request's full blocks ``len(state.block_hashes)..num_full-1``,
        taking the hashes ``chain`` already has."""
        bs = self.block_size
        tokens = request.all_token_ids
        hashes = state.block_hashes
        parent = hashes[-1] if hashes else _ROOT_HASH
        for i in range(len(hashes), num_full):
            if i < len(chain):
                parent = chain[i]
            else:
                parent = hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs])
            hashes.append(parent)
            if state.block_ids[i] != NULL_BLOCK_ID:
                self._pool.register(state.block_ids[i], parent)


class QuietLimit(NamedTuple):
    """See :meth:`KVCacheManager.quiet_limit`."""

    tokens: int
    known: int


_NO_BLOCKS = QuietLimit(-1, -1)


def _within(request: Request, num_new_tokens: int, quiet_limit: QuietLimit) -> bool:
    """Whether a step of ``num_new_tokens`` (at least one, no hits) stays within a request's
    quiet limit (see :meth:`KVCacheManager.quiet_limit`)."""
    covered = request.num_computed_tokens + num_new_tokens
    tokens, known = quiet_limit
    return (
        0 < num_new_tokens
        and covered <= tokens
        and (covered <= known or len(request.all_token_ids) <= known)
    )


class KVCacheCoordinator:
    """Every cache group's blocks for every request: the scheduler's view of the KV cache.

    One :class:`KVCacheManager` per cache group (``sliding_windows[g]`` is group ``g``'s window,
    ``None`` for full attention). A model with one kind of attention has one group and behaves
    exactly as a lone manager.

    - :meth:`allocate_slots` is atomic across groups: every group can allocate, or none changes.
    - :meth:`get_computed_blocks` reuses a cached prefix only as far as every group holds the
      whole chain of its blocks (hit length = the minimum over groups).
    - ``num_free_blocks`` is the minimum over groups, ``usage`` the maximum: the scarcest group
      is what bounds admission.
    """

    def __init__(
        self,
        num_blocks: Sequence[int],
        block_size: int,
        enable_prefix_caching: bool = True,
        sliding_windows: Sequence[int | None] = (None,),
    ) -> None:
        if len(num_blocks) != len(sliding_windows) or not num_blocks:
            raise ValueError(
                f"need one pool size per cache group, got {list(num_blocks)} for windows "
                f"{list(sliding_windows)}"
            )
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_windows = list(sliding_windows)
        self.groups = [
            KVCacheManager(n, block_size, enable_prefix_caching, w)
            for n, w in zip(num_blocks, sliding_windows)
        ]
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Per request holding blocks: its quiet limit (see allocate_slots) and its tables.
        self._quiet_limits: dict[str, QuietLimit] = {}
        self._tables: dict[str, list[list[int]]] = {}

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_blocks(self) -> int:
        """The smallest group's pool size (null block included)."""
        return min(g.num_blocks for g in self.groups)

    @property
    def num_free_blocks(self) -> int:
        """Allocatable blocks of the group with the fewest."""
        return min(g.num_free_blocks for g in self.groups)

    @property
    def usage(self) -> float:
        """The largest usage over groups."""
        return max(g.usage for g in self.groups)

    def get_computed_blocks(self, request: Request) -> tuple[tuple[list[int], ...], int]:
        """Per group, the cached blocks of the longest prefix that every group holds.

        Returns the per-group block ids (pass them as they are to :meth:`allocate_slots`, in the
        same scheduling pass) and the number of tokens they hold. Returns ``((), 0)`` without
        counting a query when prefix caching is off or the request wants prompt logprobs.
        """
        if not self.enable_prefix_caching or request.wants_prompt_logprobs:
            return (), 0
        self.prefix_cache_queries += request.num_tokens
        hashes: list[int] = []  # same tokens and block size: one chain of hashes for all groups
        chains = []
        num_hit = None
        for group in self.groups:
            chain = group.find_cached_chain(request, hashes) if num_hit != 0 else []
            chains.append(chain)
            num_hit = len(chain) if num_hit is None else min(num_hit, len(chain))
        num_hit_tokens = num_hit * self.block_size
        self.prefix_cache_hits += num_hit_tokens
        return tuple(chain[:num_hit] for chain in chains), num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[Sequence[int]] = (),
    ) -> bool:
        """Allocate this step's slots in every group, or (returning False) in none.

        Most steps need nothing (a decode token inside the last block): those cost one lookup
        of the request's quiet limit (:meth:`KVCacheManager.quiet_limit`, the minimum over
        groups, kept here from the request's last allocation until :meth:`free`). Every
        allocation and free must go through the coordinator for that limit to stay right.
        """
        if not new_computed_blocks and _within(
            request, num_new_tokens, self._quiet_limits.get(request.request_id, _NO_BLOCKS)
        ):
            return True
        # Every group is planned and allocated (one with nothing to do does nothing): cheaper
        # than asking each whether it is quiet first.
        groups = self.groups
        hits = new_computed_blocks or [()] * len(groups)
        if new_computed_blocks:
            for group, blocks in zip(groups, hits):
                group.check_computed_blocks(request, blocks)
        plans = [
            group._plan(request, num_new_tokens, blocks) for group, blocks in zip(groups, hits)
        ]
        for group, plan in zip(groups, plans):
            if plan[2] > group.num_free_blocks:
                return False
        request_id = request.request_id
        chain: Sequence[int] = ()
        for group, blocks, plan in zip(groups, hits, plans):
            group._allocate(request, num_new_tokens, blocks, plan, chain)
            chain = group.block_hashes(request_id)
        self._quiet_limits[request_id] = self._group_quiet_limit(request_id)
        if request_id not in self._tables:
            self._tables[request_id] = [g.block_table(request_id) for g in self.groups]
        return True

    def _group_quiet_limit(self, request_id: str) -> QuietLimit:
        """The quiet limit of every group at once: each bound's minimum over the groups."""
        limits = [g.quiet_limit(request_id) for g in self.groups]
        return QuietLimit(
            min(limit.tokens for limit in limits), min(limit.known for limit in limits)
        )

    def free(self, request: Request) -> None:
        """Drop the request's blocks in every group (see :meth:`KVCacheManager.free`)."""
        self._quiet_limits.pop(request.request_id, None)
        self._tables.pop(request.request_id, None)
        for group in self.groups:
            group.free(request)

    def block_table(self, request_id: str, group: int = 0) -> list[int]:
        """The request's block table in cache group ``group`` (the live list: don't mutate)."""
        return self.groups[group].block_table(request_id)

    def block_tables(self, request_id: str) -> list[list[int]]:
        """The request's block table in every cache group, in group order (the live lists,
        in a list kept while the request holds blocks: read, don't mutate)."""
        tables = self._tables.get(request_id)
        return tables if tables is not None else [[] for _ in self.groups]

    def reset_prefix_cache(self) -> bool:
        """Forget all cached content; refused (False) while any request holds blocks."""
        if any(g.num_free_blocks != g.num_blocks - 1 for g in self.groups):
            return False
        for group in self.groups:
            group.reset_prefix_cache()
        return True

    def check_invariants(self) -> None:
        """Every group's invariants, and that all groups hold the same requests."""
        for group in self.groups:
            group.check_invariants()
        requests = [set(g._requests) for g in self.groups]
        if any(r != requests[0] for r in requests):
            raise RuntimeError("cache groups disagree on which requests hold blocks")
        if set(self._quiet_limits) != requests[0] or set(self._tables) != requests[0]:
            raise RuntimeError("quiet limits or tables kept for requests holding no blocks")
        for request_id, limit in self._quiet_limits.items():
            if limit != self._group_quiet_limit(request_id):
                raise RuntimeError(f"request {request_id}: stale quiet limit {limit}")
            if any(
                t is not g.block_table(request_id)
                for t, g in zip(self._tables[request_id], self.groups)
            ):
                raise RuntimeError(f"request {request_id}: kept tables are not the live ones")
