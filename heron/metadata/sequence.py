"""Per-step shared metadata: the host-side StepBatch and the device-side SequenceMetadata."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


class StepBatch:
    """One step's batch on the host, laid out in a single packed int32 array.

    The runner writes token ids, positions, slots, per-request query/KV lengths, block tables
    and the rows to compute logits for into the named views; slots and block tables come once per
    KV cache group (``group_slot_mappings[g]``, ``group_block_tables[g]``; ``slot_mapping`` and
    ``block_tables`` are group 0's); :meth:`finish` fills both
    cumulative-length arrays with one cumsum over the stacked lengths. The packed array then
    travels to the device in one copy (:meth:`SequenceMetadata.from_step_batch`).
    """

    def __init__(
        self,
        num_reqs: int,
        num_tokens: int,
        num_logits: int,
        table_width: int,
        block_size: int,
        staging: torch.Tensor | None = None,
        num_groups: int = 1,
    ) -> None:
        self.num_reqs, self.num_tokens = num_reqs, num_tokens
        self.num_logits, self.table_width, self.block_size = num_logits, table_width, block_size
        self.num_groups = num_groups
        sizes = self._sizes(num_reqs, num_tokens, num_logits, table_width, num_groups)
        total = sum(sizes.values())
        # A reused (pinned) host buffer, so that the copy to a GPU is one asynchronous DMA.
        self.packed = torch.empty(total, dtype=torch.int32) if staging is None else staging[:total]
        flat = self.packed.numpy()
        # Zeroed by numpy, on this thread: a PyTorch fill of a long batch fans out to every core,
        # and waits for all of them on a busy or virtualised host.
        flat.fill(0)
        self.sizes = list(sizes.values())  # of the parts, in the order of ``offsets``
        self.offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in sizes.items():
            self.offsets[name] = (start, start + size)
            start += size
        view = lambda name: flat[self.offsets[name][0] : self.offsets[name][1]]
        self.start_locs = view("start_locs").reshape(2, num_reqs + 1)
        self.lens = view("lens").reshape(2, num_reqs)
        self.query_lens, self.kv_lens = self.lens[0], self.lens[1]
        self.token_ids = view("token_ids")
        self.positions = view("positions")
        self.group_slot_mappings = view("slot_mapping").reshape(num_groups, num_tokens)
        self.logits_indices = view("logits_indices")
        self.group_block_tables = view("block_tables").reshape(num_groups, num_reqs, table_width)
        self.slot_mapping = self.group_slot_mappings[0]
        self.block_tables = self.group_block_tables[0]

    @staticmethod
    def _sizes(
        num_reqs: int, num_tokens: int, num_logits: int, width: int, num_groups: int = 1
    ) -> dict[str, int]:
        return {
            "start_locs": 2 * (num_reqs + 1),
            "lens": 2 * num_reqs,
            "token_ids": num_tokens,
            "positions": num_tokens,
            "slot_mapping": num_groups * num_tokens,
            "logits_indices": num_logits,
            "block_tables": num_groups * num_reqs * width,
        }

    @classmethod
    def packed_size(
        cls, num_reqs: int, num_tokens: int, num_logits: int, width: int, num_groups: int = 1
    ) -> int:
        """Elements of the packed array for these dimensions."""
        return sum(cls._sizes(num_reqs, num_tokens, num_logits, width, num_groups).values())

    def finish(self) -> None:
        """Compute the cumulative query and KV lengths (one cumsum over both)."""
        np.cumsum(self.lens, axis=1, out=self.start_locs[:, 1:])


@dataclass(frozen=True)
class SequenceMetadata:
    """The step's sequence facts on the device, built once per step from a :class:`StepBatch`.

    Builders derive their groups' views from this; operators never read it directly.
    Host copies of the lengths are kept for eager kernels that loop over requests. Slots and
    block tables exist once per KV cache group (``group_slot_mappings``, ``group_block_tables``);
    ``slot_mapping`` and ``block_tables`` are group 0's.
    """

    num_reqs: int
    num_tokens: int
    max_query_len: int
    max_kv_len: int
    block_size: int
    is_decode: bool  # every request has exactly one query token
    query_lens_host: np.ndarray
    kv_lens_host: np.ndarray
    query_start_host: np.ndarray
    token_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_lens: torch.Tensor
    kv_lens: torch.Tensor
    query_start_loc: torch.Tensor
    kv_start_loc: torch.Tensor
    block_tables: torch.Tensor
    logits_indices: torch.Tensor
    group_slot_mappings: tuple[torch.Tensor, ...] = ()
    group_block_tables: tuple[torch.Tensor, ...] = ()

    @property
    def num_groups(self) -> int:
        return len(self.group_block_tables)

    @classmethod
    def from_step_batch(cls, batch: StepBatch, device: torch.device) -> SequenceMetadata:
        packed = batch.packed.to(device, non_blocking=True)
        # One split into the named parts (cheaper than slicing each).
        part = dict(zip(batch.offsets, packed.split_with_sizes(batch.sizes)))
        query_start_loc, kv_start_loc = part["start_locs"].view(2, batch.num_reqs + 1).unbind(0)
        query_lens, kv_lens = part["lens"].view(2, batch.num_reqs).unbind(0)
        g, r, t, w = batch.num_groups, batch.num_reqs, batch.num_tokens, batch.table_width
        group_slot_mappings = tuple(part["slot_mapping"].view(g, t).unbind(0))
        group_block_tables = tuple(part["block_tables"].view(g, r, w).unbind(0))
        return cls(
            num_reqs=batch.num_reqs,
            num_tokens=batch.num_tokens,
            max_query_len=int(batch.query_lens.max()) if batch.num_reqs else 0,
            max_kv_len=int(batch.kv_lens.max()) if batch.num_reqs else 0,
            block_size=batch.block_size,
            is_decode=batch.num_tokens == batch.num_reqs,
            query_lens_host=batch.query_lens,
            kv_lens_host=batch.kv_lens,
            query_start_host=batch.start_locs[0],
            token_ids=part["token_ids"],
            positions=part["positions"],
            slot_mapping=group_slot_mappings[0],
            query_lens=query_lens,
            kv_lens=kv_lens,
            query_start_loc=query_start_loc,
            kv_start_loc=kv_start_loc,
            block_tables=group_block_tables[0],
            logits_indices=part["logits_indices"],
            group_slot_mappings=group_slot_mappings,
            group_block_tables=group_block_tables,
        )
