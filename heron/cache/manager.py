"""The interface between the coordinator and one cache group's manager.

:class:`~heron.cache.coordinator.KVCacheCoordinator` drives one :class:`CacheManager` per cache
group and reaches nothing else of it, so a manager of another kind (paged blocks today; one
state slot per request for a recurrent layer) plugs in through its spec's ``make_manager``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    from heron.cache.block_pool import BlockPool


class CachedSequence(Protocol):
    """What the cache reads of a request: its id, its tokens and how many are computed. The
    engine's ``Request`` is one; the cache never imports it."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int
    prefix_root: int  # its chain of block hashes starts here (``block_pool.root_hash``)

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def wants_prompt_logprobs(self) -> bool: ...

    @property
    def keep_state_at(self) -> int:
        """After how many tokens a per-request state is kept for another instance (0: not)."""
        ...

    def block_extras(self, start: int, end: int) -> tuple[str, ...]:
        """What tokens ``start .. end`` depend on beside their ids (``hash_block_tokens``)."""
        ...


class AllocationHeadroom(NamedTuple):
    """Blocks already allocated cover steps up to ``tokens`` tokens (``num_computed_tokens +
    num_new_tokens``), ``known`` of them known: such a step needs nothing, so skips planning."""

    tokens: int
    known: int


NO_HEADROOM = AllocationHeadroom(-1, -1)
"""The headroom of a request holding nothing."""


def within_headroom(
    request: CachedSequence, num_new_tokens: int, headroom: AllocationHeadroom
) -> bool:
    """Whether a step of ``num_new_tokens`` (at least one, no hits) needs no allocation."""
    covered = request.num_computed_tokens + num_new_tokens
    tokens, known = headroom
    return (
        0 < num_new_tokens
        and covered <= tokens
        and (covered <= known or len(request.all_token_ids) <= known)
    )


class StateCopies(NamedTuple):
    """A scheduling pass's copies of one group's entries: ``before`` and ``after`` the step,
    ``(source, destination)``; ``verified``: ``(request_id, position, destination)``, the state
    a verification step's row reached after its token ``position`` (not its last), saved once
    the step has verified that token (a refused one leaves nothing). ``registered`` and
    ``confirmed``: ``(entry, hash)`` of the checkpoints that became findable this pass, their
    states written by this step (its ``after`` or ``verified`` copies) or by earlier steps (a
    KV connector copies the first out after the step, the second before it, since the pass may
    hand their entries out again)."""

    before: list[tuple[int, int]]
    after: list[tuple[int, int]]
    verified: list[tuple[str, int, int]]
    registered: Sequence[tuple[int, int]] = ()
    confirmed: Sequence[tuple[int, int]] = ()


class AllocationPlan(Protocol):
    """What a manager decided for one step; the coordinator reads only its cost."""

    @property
    def num_needed(self) -> int:
        """By how much committing the plan lowers ``num_free_blocks`` (negative if it frees)."""
        ...


class CacheManager(ABC):
    """One cache group's per-request state over its own pool (entry 0 reserved as null).

    A step is planned in every group first and committed only if every plan fits, so
    :meth:`plan` must change nothing. Hits (``hits``) are the group's blocks from
    :meth:`find_cached_chain`, given only on a request's first allocation.
    """

    num_blocks: int
    """Pool size, null entry included."""
    # (and ``spec``, the group's cache spec: typed by each kind, as this module sits below
    # the specs)

    @property
    @abstractmethod
    def num_free_blocks(self) -> int:
        """Entries allocatable now (cached ones that would be evicted included)."""

    @property
    def usage(self) -> float:
        """Fraction of the usable entries (all but the null one) held by requests."""
        return (self.num_blocks - 1 - self.num_free_blocks) / (self.num_blocks - 1)

    def describe_pool(self) -> str:
        """The pool's size and what it holds, for the start-up log and ``heron plan``."""
        return (
            f"{self.num_blocks - 1} blocks ({(self.num_blocks - 1) * self.spec.block_size} tokens)"
        )

    @abstractmethod
    def find_cached_chain(
        self, request: CachedSequence, hashes: list[int] | None = None
    ) -> list[int]:
        """The cached blocks heading ``request``'s first ``num_tokens - 1`` tokens (no counting).

        ``hashes`` carries the chain hashes between groups of one block size: the ones given
        are used, the ones computed are appended.
        """

    @abstractmethod
    def check_hits(self, request: CachedSequence, hits: Sequence[int]) -> None:
        """Raise ``ValueError`` if ``hits`` are not acceptable for ``request`` now."""

    def chunk_end(self, request: CachedSequence, start: int, end: int) -> int:
        """Where a step computing tokens ``start:end`` should end (``end`` unless the group
        keeps something at a point before it)."""
        return end

    def take_state_copies(self) -> StateCopies:
        """This scheduling pass's entry copies; called once per pass, when its plan is sealed.
        None for most kinds."""
        return StateCopies([], [], [])

    @abstractmethod
    def plan(
        self, request: CachedSequence, num_new_tokens: int, hits: Sequence[int]
    ) -> AllocationPlan:
        """What a step of ``num_new_tokens`` after ``hits`` needs (changes nothing)."""

    @abstractmethod
    def commit(
        self,
        request: CachedSequence,
        num_new_tokens: int,
        hits: Sequence[int],
        plan: AllocationPlan,
        chain: Sequence[int] = (),
    ) -> None:
        """Carry out ``plan``, checked to fit. ``chain``: the request's block hashes as another
        group (of the same block size) has them, to reuse rather than recompute."""

    @abstractmethod
    def headroom(self, request_id: str) -> AllocationHeadroom:
        """The request's headroom after its last commit (:data:`NO_HEADROOM` if it holds
        nothing); only rises until :meth:`free` or :meth:`truncate`."""

    @abstractmethod
    def block_table(self, request_id: str) -> list[int]:
        """The request's entries in token order (the live list: read, don't mutate)."""

    def loads(self, request_id: str) -> None:
        """The request's entries allocated this pass are filled by a KV connector's load
        (none of this group's copies into or out of them may run)."""

    def transfer_table(self, request_id: str) -> list[int]:
        """The entries another instance reads the request's prompt from (its blocks, unless
        the group keeps a state of its own for that)."""
        return self.block_table(request_id)

    @abstractmethod
    def block_hashes(self, request_id: str) -> Sequence[int]:
        """The request's registered chain of block hashes (live: read, don't mutate)."""

    @abstractmethod
    def request_ids(self) -> Collection[str]:
        """The requests holding entries."""

    @abstractmethod
    def free(self, request: CachedSequence, chain: Sequence[int] = ()) -> None:
        """Drop everything the request holds; unknown requests are a no-op. ``chain``: the
        request's block hashes as a group of the same block size has them at the end."""

    def truncate(self, request: CachedSequence, num_tokens: int) -> None:
        """Give back what the request holds past its first ``num_tokens`` tokens (tokens a
        verification step computed and refused). A kind whose entries cannot be cut back says
        so here; the engine refuses speculative decoding for it up front."""
        raise NotImplementedError(f"{type(self).__name__}: entries cannot be cut back")

    @abstractmethod
    def reset_prefix_cache(self) -> bool:
        """Forget all cached content; refused (False) while any request holds entries."""

    @abstractmethod
    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` if the pool and per-request state disagree."""


def refuse_late_hits(
    request: CachedSequence,
    held: Collection[str],
    pool: BlockPool,
    needed: Sequence[int],
    entry: str,
) -> None:
    """A manager's :meth:`CacheManager.check_hits`: hits are refused past the request's first
    allocation (``held``: the requests holding entries), or once an entry of ``needed`` (the
    hits that must still be cached) was evicted since the lookup."""
    if request.request_id in held:
        raise ValueError(
            f"request {request.request_id}: new_computed_blocks is only accepted on the "
            "first allocation"
        )
    if any(pool.block_hash[b] is None for b in needed):
        raise ValueError(
            f"request {request.request_id}: {entry} was evicted since get_computed_blocks; "
            "allocate in the same scheduling pass as the lookup"
        )
