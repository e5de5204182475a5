"""Every cache group's blocks for every request: the scheduler's view of the cache."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from heron.cache.manager import (
    NO_HEADROOM,
    AllocationHeadroom,
    CachedSequence,
    CacheManager,
    StateCopies,
    within_headroom,
)

if TYPE_CHECKING:
    from heron.cache.spec import CacheSpec


class GroupUsage(NamedTuple):
    """One cache group's pool, for metrics and logs."""

    group: int
    spec: CacheSpec
    num_blocks: int  # null block included
    num_free_blocks: int
    usage: float


class KVCacheCoordinator:
    """One manager per cache group (``specs[g]`` is group ``g``'s spec, ``num_blocks[g]`` its
    pool size), each made by its spec. A model with one kind of attention has one group.

    - :meth:`allocate_slots` is atomic across groups: every group can allocate, or none changes.
    - :meth:`get_computed_blocks` reuses a cached prefix only as far as every group holds the
      whole chain of its blocks (hit length = the minimum over groups).
    - ``num_free_blocks`` is the minimum over groups, ``usage`` the maximum: the scarcest group
      is what bounds admission.
    """

    def __init__(
        self,
        specs: Sequence[CacheSpec],
        num_blocks: Sequence[int],
        enable_prefix_caching: bool = True,
        decode_checkpoint_interval: int = 0,
    ) -> None:
        """``decode_checkpoint_interval``: a recurrent group keeps the state of generated
        tokens every this many blocks, beside each request's latest (0: the latest only; -1:
        none, only where prefill chunks end)."""
        if len(num_blocks) != len(specs) or not specs:
            raise ValueError(
                f"need one pool size per cache group, got {list(num_blocks)} for "
                f"{len(specs)} cache spec(s)"
            )
        block_sizes = {spec.block_size for spec in specs if spec.joins_prefix_chain}
        if len(block_sizes) > 1:
            # One hit length and one chain of block hashes serve every group that hashes.
            raise ValueError(
                f"cache groups in the prefix chain must share one block size, got "
                f"{sorted(block_sizes)}"
            )
        self.specs = list(specs)
        self.block_size = next(iter(block_sizes), 1)
        self.enable_prefix_caching = enable_prefix_caching
        # (groups outside the chain key their entries by its hashes: without it, nothing)
        chained = enable_prefix_caching and bool(block_sizes)
        self.groups: list[CacheManager] = [
            spec.make_manager(n, chained, self.block_size, decode_checkpoint_interval)
            for spec, n in zip(specs, num_blocks)
        ]
        # Groups in the chain first: the others key their entries by its hashes.
        self._chain_first = sorted(range(len(specs)), key=lambda g: not specs[g].joins_prefix_chain)
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Per request holding blocks: its headroom (see allocate_slots) and its tables.
        self._headroom: dict[str, AllocationHeadroom] = {}
        self._tables: dict[str, list[list[int]]] = {}
        # Requests whose tables this pass's allocations changed (the others kept theirs), for
        # the step plan's table updates; its reader clears it.
        self.changed_tables: list[str] = []

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

    def group_usage(self) -> list[GroupUsage]:
        """Every group's pool, in group order."""
        return [
            GroupUsage(i, g.spec, g.num_blocks, g.num_free_blocks, g.usage)
            for i, g in enumerate(self.groups)
        ]

    def get_computed_blocks(self, request: CachedSequence) -> tuple[tuple[list[int], ...], int]:
        """Per group, the cached blocks of the longest prefix that every group holds.

        Only blocks lying entirely within the first ``num_tokens - 1`` tokens can hit, so at
        least one token is left to compute (the step needs logits for it). Returns the
        per-group block ids (pass them as they are to :meth:`allocate_slots`, in the same
        scheduling pass, before anything can evict them) and the number of tokens they hold;
        takes no references. Returns ``((), 0)`` without counting a query when prefix caching
        is off or the request wants prompt logprobs (those need every prompt position computed).
        """
        if not self.enable_prefix_caching or request.wants_prompt_logprobs:
            return (), 0
        self.prefix_cache_queries += request.num_tokens
        hashes: list[int] = []  # same tokens and block size: one chain of hashes for all groups
        chains: list[list[int]] = [[] for _ in self.groups]
        num_hit = None
        for g in self._chain_first:
            group = self.groups[g]
            if not group.spec.joins_prefix_chain:
                break
            if num_hit != 0:
                chains[g] = group.find_cached_chain(request, hashes)
            num_hit = len(chains[g]) if num_hit is None else min(num_hit, len(chains[g]))
        num_hit = num_hit or 0
        # The other groups hit at their own points (checkpoints) within the chain's hit: ask
        # again with the shorter chain until every one ends where the shortest does.
        others = [g for g in self._chain_first if not self.specs[g].joins_prefix_chain]
        while others and num_hit:
            for g in others:
                chains[g] = self.groups[g].find_cached_chain(request, hashes[:num_hit])
            shortest = min(len(chains[g]) for g in others)
            if shortest == num_hit:
                break
            num_hit = shortest
        num_hit_tokens = num_hit * self.block_size
        self.prefix_cache_hits += num_hit_tokens
        return tuple(chain[:num_hit] for chain in chains), num_hit_tokens

    def chunk_end(self, request: CachedSequence, start: int, num_new_tokens: int) -> int:
        """How many of ``num_new_tokens`` tokens from ``start`` a step should compute: a group
        may cut a prefill chunk where it keeps a prefix checkpoint."""
        end = start + num_new_tokens
        return min(group.chunk_end(request, start, end) for group in self.groups) - start

    def take_state_copies(self) -> list[StateCopies]:
        """Per group, this pass's entry copies (state checkpoints); seals the pass for the
        groups' checkpoints."""
        return [group.take_state_copies() for group in self.groups]

    def allocate_slots(
        self,
        request: CachedSequence,
        num_new_tokens: int,
        new_computed_blocks: Sequence[Sequence[int]] = (),
    ) -> bool:
        """Allocate this step's slots in every group, or (returning False) in none.

        Covers ``request.num_computed_tokens`` plus the hits plus ``num_new_tokens`` tokens;
        ``new_computed_blocks`` (from :meth:`get_computed_blocks`) only on the request's first
        allocation. The caller advances ``request.num_computed_tokens`` after the step has run.

        Most steps need nothing (a decode token inside the last block): those cost one lookup
        of the request's headroom (the minimum over groups, kept here from the request's last
        allocation until :meth:`free`). Every allocation and free must go through the
        coordinator for it to stay right.
        """
        if not new_computed_blocks and within_headroom(
            request, num_new_tokens, self._headroom.get(request.request_id, NO_HEADROOM)
        ):
            return True
        # Every group is planned and committed (one with nothing to do does nothing): cheaper
        # than asking each for its headroom first.
        groups = self.groups
        hits = new_computed_blocks or [()] * len(groups)
        if new_computed_blocks:
            for group, blocks in zip(groups, hits):
                group.check_hits(request, blocks)
        plans = [group.plan(request, num_new_tokens, blocks) for group, blocks in zip(groups, hits)]
        for group, plan in zip(groups, plans):
            if plan.num_needed > group.num_free_blocks:
                return False
        request_id = request.request_id
        chain: Sequence[int] = ()
        for g in self._chain_first:
            group = groups[g]
            group.commit(request, num_new_tokens, hits[g], plans[g], chain)
            if group.spec.joins_prefix_chain:
                chain = group.block_hashes(request_id)
        self._headroom[request_id] = self._group_headroom(request_id)
        self.changed_tables.append(request_id)
        if request_id not in self._tables:
            self._tables[request_id] = [g.block_table(request_id) for g in self.groups]
        return True

    def _group_headroom(self, request_id: str) -> AllocationHeadroom:
        """The headroom of every group at once: each bound's minimum over the groups."""
        limits = [g.headroom(request_id) for g in self.groups]
        return AllocationHeadroom(
            min(limit.tokens for limit in limits), min(limit.known for limit in limits)
        )

    def free(self, request: CachedSequence) -> None:
        """Drop the request's blocks in every group (finished, aborted or preempted); unknown
        requests are a no-op. Call it after advancing ``num_computed_tokens`` for the last
        step, or the blocks that step filled are not kept in the prefix cache."""
        self._headroom.pop(request.request_id, None)
        self._tables.pop(request.request_id, None)
        chain: Sequence[int] = ()
        for g in self._chain_first:
            group = self.groups[g]
            hashes = group.block_hashes(request.request_id)  # (live: free may complete it)
            group.free(request, chain)
            if group.spec.joins_prefix_chain:
                chain = hashes

    def truncate(self, request: CachedSequence, num_tokens: int) -> None:
        """Every group gives back what the request holds past its first ``num_tokens`` tokens
        (refused proposals); its headroom shrinks with its tables and the tables count as
        changed for the next plan."""
        request_id = request.request_id
        if request_id not in self._headroom:
            return
        for group in self.groups:
            group.truncate(request, num_tokens)
        self._headroom[request_id] = self._group_headroom(request_id)
        self.changed_tables.append(request_id)

    def block_table(self, request_id: str, group: int = 0) -> list[int]:
        """The request's block table in cache group ``group`` (the live list: don't mutate)."""
        return self.groups[group].block_table(request_id)

    def block_hashes(self, request_id: str) -> Sequence[int]:
        """The chain hashes of the request's registered full blocks (live: don't mutate;
        empty where no group joins the chain or prefix caching is off)."""
        first = self._chain_first[0]
        if not self.groups[first].spec.joins_prefix_chain:
            return ()
        return self.groups[first].block_hashes(request_id)

    def block_tables(self, request_id: str) -> list[list[int]]:
        """The request's block table in every cache group, in group order (the live lists,
        in a list kept while the request holds blocks: read, don't mutate)."""
        tables = self._tables.get(request_id)
        return tables if tables is not None else [[] for _ in self.groups]

    def loads(self, request_id: str) -> None:
        """The request's entries just allocated are filled by a KV connector's load."""
        for group in self.groups:
            group.loads(request_id)

    def transfer_tables(self, request_id: str) -> list[list[int]]:
        """Per group, the entries another instance reads the request's prompt from."""
        return [g.transfer_table(request_id) for g in self.groups]

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
        requests = [set(g.request_ids()) for g in self.groups]
        if any(r != requests[0] for r in requests):
            raise RuntimeError("cache groups disagree on which requests hold blocks")
        if set(self._headroom) != requests[0] or set(self._tables) != requests[0]:
            raise RuntimeError("headroom or tables kept for requests holding no blocks")
        for request_id, headroom in self._headroom.items():
            if headroom != self._group_headroom(request_id):
                raise RuntimeError(f"request {request_id}: stale headroom {headroom}")
            if any(
                t is not g.block_table(request_id)
                for t, g in zip(self._tables[request_id], self.groups)
            ):
                raise RuntimeError(f"request {request_id}: kept tables are not the live ones")
