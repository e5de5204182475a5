"""Decode steps prepared on the device from the step before them.

A proposer's pass runs decode steps of the same rows back to back, each one position further
and fed the tokens the step before it sampled. Their metadata differs from that step's only by
positions, KV lengths and slots, so it is derived on the device from that step's, without
packing and uploading a batch or applying a plan: the block tables are the ones that step read
(nothing changed them since), and each row's next position comes from that step's device
lengths, which already hold any refusals a verification moved its rows back by.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from heron.cache.paged_parts import PagedParts
from heron.cache.spec import CacheSpec, PagedSpec
from heron.execution.step_plan import StepPlan
from heron.metadata import SequenceMetadata


def can_chain_decode_steps(specs: list[CacheSpec]) -> bool:
    """Whether every cache is paged with each row's table read from its first block (no
    window moves a row's table start as it advances)."""
    return all(
        isinstance(spec, PagedSpec) and type(spec).first_table_block is PagedSpec.first_table_block
        for spec in specs
    )


@dataclass(frozen=True)
class NextDecode:
    """What the decode step after a launched step needs of it: its rows' requests in order,
    its cache groups' paged parts on the device, each row's next position on the device, and
    the runner's count of launches when it was launched (it serves only the very next one)."""

    request_ids: list[str]
    group_parts: tuple[PagedParts, ...]
    positions: torch.Tensor  # [rows] int32
    launch: int


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


def next_decode_metadata(
    after: NextDecode,
    token_ids: torch.Tensor,
    kv_lens_host: np.ndarray,
    block_size: int,
    counting: torch.Tensor,
) -> SequenceMetadata:
    """The decode step of ``after``'s rows at their next positions, fed ``token_ids``;
    ``kv_lens_host``: the host's KV lengths (at most one past each table's allocated
    blocks); ``counting``: ``0, 1, 2, ...`` on the device, at least one longer than the
    rows."""
    n = len(kv_lens_host)
    positions = after.positions
    blocks = (positions // block_size).long().unsqueeze(1)
    offsets = positions % block_size
    group_parts = tuple(
        replace(
            parts,
            slot_mapping=parts.block_tables.gather(1, blocks).squeeze(1) * block_size + offsets,
        )
        for parts in after.group_parts
    )
    ones = np.ones(n, dtype=np.int32)
    return SequenceMetadata(
        num_reqs=n,
        num_tokens=n,
        max_query_len=1,
        max_kv_len=int(kv_lens_host.max()),
        block_size=block_size,
        is_decode=True,
        query_lens_host=ones,
        kv_lens_host=kv_lens_host,
        query_start_host=np.arange(n + 1, dtype=np.int32),
        token_ids=token_ids,
        positions=positions,
        kv_lens=positions + 1,
        query_start_loc=counting[: n + 1],
        logits_indices=counting[:n],
        group_parts=group_parts,
    )
