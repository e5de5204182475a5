"""The blocks of one cache pool: reference counts, the LRU free queue and prefix-cache hashes.

A block whose tokens are all known is *registered* under a hash of its content and of everything
before it, so a later request whose prompt starts with the same tokens can reuse it instead of
recomputing it. A block with reference count 0 sits in the free queue whether or not it is
registered; a registered one stays findable by hash (and can be revived by a hit) until it
reaches the head of the queue and is handed out again, which is when its hash entry is dropped
(eviction).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

NULL_BLOCK_ID = 0
"""Never handed out: padded rows of a batch point their block tables at it."""

# Parent hash of each sequence's first block. Any fixed int does; it only has to agree between
# processes sharing hashes, and int/tuple hashes (unlike str) are not salted by PYTHONHASHSEED.
ROOT_HASH = 0x6865726F6E


def root_hash(salt: int) -> int:
    """The root of a request's chain of block hashes: requests whose KV differs for the same
    tokens (under different LoRA adapters) start from different roots (salt 0: the base
    model's, ``ROOT_HASH``)."""
    return hash((ROOT_HASH, salt)) if salt else ROOT_HASH


def hash_block_tokens(
    parent_hash: int, token_ids: Sequence[int], extras: tuple[str, ...] = ()
) -> int:
    """Hash of a full block, chained to the hash of the block before it; ``extras`` are what
    the block's KV depends on beside its tokens (the content hashes of the images whose
    placeholders it holds).

    Python's built-in 64-bit tuple hash: cheap, and deterministic across processes. See
    :class:`~heron.cache.paged.PagedCacheManager` for what a collision costs.
    """
    if extras:
        return hash((parent_hash, tuple(token_ids), extras))
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

    def release_to_head(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block; those reaching 0 join the queue head, to be taken
        first (blocks whose content no one will look up)."""
        free_queue, ref_cnt = self.free_queue, self.ref_cnt
        for block_id in block_ids:
            ref_cnt[block_id] -= 1
            if ref_cnt[block_id] == 0:
                free_queue[block_id] = None
                free_queue.move_to_end(block_id, last=False)

    def register(self, block_id: int, block_hash: int) -> None:
        """Make ``block_id`` findable under ``block_hash`` unless another block already is.

        Keeping the existing entry (no dedupe) means the duplicate just stays unregistered and is
        reused as an ordinary block once freed.
        """
        if block_hash not in self.cached:
            self.cached[block_hash] = block_id
            self.block_hash[block_id] = block_hash

    def discard(self, block_id: int) -> None:
        """Drop a free block's hash entry and move it to the queue head: its content is one no
        one will look up any more."""
        self.uncache(block_id)
        self.free_queue.move_to_end(block_id, last=False)

    def uncache(self, block_id: int) -> None:
        """Drop ``block_id``'s hash entry, if it has one."""
        h = self.block_hash[block_id]
        if h is not None:
            del self.cached[h]
            self.block_hash[block_id] = None

    def reset_hashes(self) -> bool:
        """Forget every hash entry (blocks stay where they are), only while no block is held:
        False, changing nothing, while one is."""
        if self.num_free != self.num_blocks - 1:
            return False
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        return True

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
