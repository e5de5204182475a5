"""Decode steps prepared on the device from the step before them.

A proposer's pass runs decode steps of the same rows back to back, each one position further
and fed the tokens the step before it sampled. Their metadata differs from that step's only by
positions, KV lengths and slots, so it is derived on the device, without packing and uploading
a batch or applying a plan: the block tables are the ones that step read (nothing changed them
since), and each row's next position comes from that step's device lengths, which already hold
any refusals a verification moved its rows back by. A :class:`DecodeChain` computes the
metadata of several such steps at once (a few launches), so each step of it takes views only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from heron.cache.paged import PagedSpec
from heron.cache.paged_parts import PagedParts
from heron.cache.spec import CacheSpec
from heron.execution.step_inputs import BlockTableRows, PreparedStep
from heron.execution.step_plan import DeviceDrafts, Rollback, StepPlan
from heron.metadata import SequenceMetadata

if TYPE_CHECKING:
    from heron.execution.launched import LaunchedStep


def can_chain_decode_steps(specs: list[CacheSpec]) -> bool:
    """Whether every cache is paged with each row's table read from its first block (no
    window moves a row's table start as it advances)."""
    return all(
        isinstance(spec, PagedSpec) and type(spec).first_table_block is PagedSpec.first_table_block
        for spec in specs
    )


def is_plain_decode(plan: StepPlan) -> bool:
    """Every row decodes one sampled token, and the plan changes nothing else."""
    return (
        all(n == 1 for n in plan.num_new)
        and all(plan.samples)
        and not (
            plan.new_requests
            or plan.table_updates
            or plan.preempted_ids
            or plan.finished_ids
            or plan.copies_before
            or plan.copies_after
            or plan.verifies
            or plan.device_inputs
            or plan.token_bitmask is not None
        )
    )


@dataclass(frozen=True)
class DecodeChain:
    """The metadata of the next ``num_steps`` decode steps of some rows, on the device: step
    ``j`` puts each row at ``positions[j]``, one past step ``j - 1``; slots from the tables of
    ``group_parts`` (a step past a table's blocks gets a stale slot: the runner chains only
    steps whose tables hold them). What the steps share is made once."""

    group_parts: tuple[PagedParts, ...]
    block_size: int
    num_steps: int
    positions: torch.Tensor  # [steps, rows] int32
    kv_lens: torch.Tensor  # [steps, rows] int32
    slots: tuple[torch.Tensor, ...]  # per group, [steps, rows] int32
    query_start_loc: torch.Tensor  # 0, 1, ..., rows
    query_lens_host: np.ndarray
    query_start_host: np.ndarray

    @classmethod
    def start(
        cls,
        group_parts: tuple[PagedParts, ...],
        positions: torch.Tensor,
        num_steps: int,
        block_size: int,
        counting: torch.Tensor,
    ) -> DecodeChain:
        """``num_steps`` steps from each row's ``positions`` on; ``counting``: ``0, 1, 2, ...``
        on the device, longer than ``num_steps`` and the rows."""
        steps = positions[None, :] + counting[:num_steps, None]
        blocks = (steps // block_size).long().T
        offsets = steps % block_size
        slots = []
        for parts in group_parts:
            tables = parts.block_tables
            index = blocks.clamp_max(tables.shape[1] - 1)
            slot = torch.add(offsets, tables.gather(1, index).T, alpha=block_size)
            slots.append(slot.contiguous())  # (rows of it are a step's: kernels read them flat)
        n = positions.shape[0]
        return cls(
            group_parts,
            block_size,
            num_steps,
            steps,
            steps + 1,
            tuple(slots),
            counting[: n + 1],
            np.ones(n, dtype=np.int32),
            np.arange(n + 1, dtype=np.int32),
        )

    def step(self, j: int, token_ids: torch.Tensor, kv_lens_host: np.ndarray) -> SequenceMetadata:
        """Step ``j``'s metadata, fed ``token_ids``; ``kv_lens_host``: the host's KV lengths."""
        n = len(kv_lens_host)
        group_parts = tuple(
            replace(parts, slot_mapping=slots[j])
            for parts, slots in zip(self.group_parts, self.slots)
        )
        return SequenceMetadata(
            num_reqs=n,
            num_tokens=n,
            max_query_len=1,
            max_kv_len=int(kv_lens_host.max()),
            block_size=self.block_size,
            is_decode=True,
            query_lens_host=self.query_lens_host,
            kv_lens_host=kv_lens_host,
            query_start_host=self.query_start_host,
            token_ids=token_ids,
            positions=self.positions[j],
            kv_lens=self.kv_lens[j],
            query_start_loc=self.query_start_loc,
            logits_indices=self.query_start_loc[:n],
            group_parts=group_parts,
        )


@dataclass(frozen=True)
class NextDecode:
    """What the decode step after a launched step needs of it: its rows' requests in order,
    its cache groups' paged parts, each row's next position (on the device), the runner's
    count of launches when it was launched (it serves only the very next one), and, for a
    step of a chain, the chain and the next step's index in it."""

    request_ids: list[str]
    group_parts: tuple[PagedParts, ...]
    positions: torch.Tensor  # [rows] int32
    launch: int
    chain: DecodeChain | None = None
    index: int = 0


class DecodeChainer:
    """Prepares a decode step on the device from the step launched right before it, where
    :meth:`enable` turned that on and every cache allows it (:func:`can_chain_decode_steps`).

    The runner calls :meth:`prepare` at every launch (it counts launches: a step serves only
    the very next one) and :meth:`keep` on each launched step whose rows may decode next.
    """

    def __init__(self, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        self.enabled = False
        self._length = 1
        self._chained: tuple[DecodeChain, int] | None = None  # this launch's step of a chain
        self._launches = 0
        self._counting = torch.zeros(0, dtype=torch.int32)  # 0, 1, 2, ... on the device

    def reset(self) -> None:
        """Forget the chain in progress and its device tensors (sleep mode)."""
        self._chained = None
        self._counting = torch.zeros(0, dtype=torch.int32)

    def enable(self, length: int, specs: list[CacheSpec]) -> None:
        """Chain decode steps, ``length`` computed at once, where ``specs`` allow it."""
        self.enabled = can_chain_decode_steps(specs)
        self._length = length

    def prepare(
        self,
        plan: StepPlan,
        previous: LaunchedStep | None,
        drafts: DeviceDrafts | None,
        rollback: Rollback | None,
        tables: BlockTableRows,
    ) -> PreparedStep | None:
        """``plan``'s step prepared on the device from ``previous``'s, where it is the next
        decode step of the same rows, launched right after it, whose ``tables`` hold every
        row's next token; None otherwise. The first such step after a step prepared on the
        host starts a chain of :meth:`enable`'s length."""
        self._launches += 1
        self._chained = None
        after = getattr(previous, "next_decode", None)
        if (
            after is None
            or after.launch != self._launches - 1
            or drafts is not None
            or rollback is not None
            or plan.request_ids != after.request_ids
            or not is_plain_decode(plan)
        ):
            return None
        kv_lens = np.array(plan.num_computed, dtype=np.int32) + 1
        rows = tables.rows(plan.request_ids)
        if not tables.covers(rows, -(-kv_lens // self.block_size)):
            return None
        n = len(kv_lens)
        chain, j = after.chain, after.index
        if chain is None or j == chain.num_steps:
            if self._counting.shape[0] <= max(n, self._length):
                size = 2 * max(n, self._length) + 1
                self._counting = torch.arange(size, dtype=torch.int32, device=self.device)
            chain = DecodeChain.start(
                after.group_parts, after.positions, self._length, self.block_size, self._counting
            )
            j = 0
        self._chained = chain, j
        tables.wrote(rows, kv_lens)
        seq = chain.step(j, previous.token_ids, kv_lens)
        return PreparedStep(seq, previous.sample_states, slice(0, n), [], [], [])

    def keep(
        self,
        launched: LaunchedStep,
        plan: StepPlan,
        seq: SequenceMetadata,
        rejected: torch.Tensor | None = None,
    ) -> None:
        """Where chaining is on, ``launched`` (a row's token sampled after its last, or after
        its last but ``rejected[i]``) keeps what the decode step after it needs."""
        if not self.enabled:
            return
        if self._chained is not None:  # a step of a chain: the next one follows in it
            chain, j = self._chained
            launched.next_decode = NextDecode(
                plan.request_ids, chain.group_parts, chain.kv_lens[j], self._launches, chain, j + 1
            )
            return
        positions = seq.kv_lens if rejected is None else seq.kv_lens - rejected
        launched.next_decode = NextDecode(
            plan.request_ids, seq.group_parts, positions, self._launches
        )
