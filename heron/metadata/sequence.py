"""Per-step shared metadata: the host-side StepBatch and the device-side SequenceMetadata."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

# Every array (and every block-table row) of the packed batch starts on a multiple of this many
# int32s (64 bytes). Triton compiles a kernel once per pattern of pointer alignments and of
# integer arguments divisible by 16 (a table's row stride): arrays at step-dependent offsets
# would have it compile new variants in the middle of a run.
_ALIGN = 16


def _padded(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@functools.lru_cache(maxsize=256)
def _layout(
    num_reqs: int, num_tokens: int, num_logits: int, width: int, num_groups: int
) -> tuple[dict[str, tuple[int, int, int, int]], int]:
    """Each part's ``(start, rows, columns, row stride)`` in the packed array, and its size.

    Parts follow one another, each row on its own 16-element boundary. Decode steps repeat the
    same dimensions, so layouts are cached.
    """
    shapes = {
        "start_locs": (2, num_reqs + 1),
        "lens": (2, num_reqs),
        "token_ids": (1, num_tokens),
        "positions": (1, num_tokens),
        "slot_mapping": (num_groups, num_tokens),
        "table_starts": (num_groups, num_reqs),
        "logits_indices": (1, num_logits),
        "block_tables": (num_groups * num_reqs, width),
    }
    parts, start = {}, 0
    for name, (rows, cols) in shapes.items():
        parts[name] = (start, rows, cols, _padded(cols))
        start += rows * _padded(cols)
    return parts, start


class StepBatch:
    """One step's batch on the host, laid out in a single packed int32 array.

    The runner writes token ids, positions, slots, per-request query/KV lengths, block tables
    and the rows to compute logits for into the named views; slots, block tables and each row's
    first table block (the table index its row starts at) come once per KV cache group
    (``group_slot_mappings[g]``, ``group_block_tables[g]``, ``group_table_starts[g]``;
    ``slot_mapping`` and ``block_tables`` are group 0's); :meth:`finish` fills both
    cumulative-length arrays with one cumsum over the stacked lengths. The packed array then
    travels to the device in one copy (:meth:`SequenceMetadata.from_step_batch`).

    Every array (each row of a stacked one, each row of a block table) starts at a multiple of
    16 elements, so the device tensors' alignments and row strides do not change from step to
    step (the tables' row stride is ``table_width`` rounded up to 16).
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
        self.parts, total = _layout(num_reqs, num_tokens, num_logits, table_width, num_groups)
        # A reused (pinned) host buffer, so that the copy to a GPU is one asynchronous DMA.
        self.packed = torch.empty(total, dtype=torch.int32) if staging is None else staging[:total]
        flat = self.packed.numpy()
        # Zeroed by numpy, on this thread: a PyTorch fill of a long batch fans out to every core,
        # and waits for all of them on a busy or virtualised host.
        flat.fill(0)

        def rows(name: str) -> np.ndarray:
            start, n, cols, stride = self.parts[name]
            return flat[start : start + n * stride].reshape(n, stride)[:, :cols]

        def row(name: str) -> np.ndarray:
            start, _, cols, _ = self.parts[name]
            return flat[start : start + cols]

        self.start_locs = rows("start_locs")
        self.lens = rows("lens")
        self.query_lens, self.kv_lens = self.lens[0], self.lens[1]
        self.token_ids = row("token_ids")
        self.positions = row("positions")
        self.group_slot_mappings = rows("slot_mapping")
        self.group_table_starts = rows("table_starts")
        self.logits_indices = row("logits_indices")
        self.group_block_tables = rows("block_tables").reshape(num_groups, num_reqs, table_width)
        self.slot_mapping = self.group_slot_mappings[0]
        self.block_tables = self.group_block_tables[0]

    @classmethod
    def packed_size(
        cls, num_reqs: int, num_tokens: int, num_logits: int, width: int, num_groups: int = 1
    ) -> int:
        """Elements of the packed array for these dimensions."""
        return _layout(num_reqs, num_tokens, num_logits, width, num_groups)[1]

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
    kv_lens: torch.Tensor
    query_start_loc: torch.Tensor
    block_tables: torch.Tensor
    logits_indices: torch.Tensor
    group_slot_mappings: tuple[torch.Tensor, ...] = ()
    group_block_tables: tuple[torch.Tensor, ...] = ()
    # Per group, [reqs]: the table index of each row's first entry (0 without a window).
    group_table_starts: tuple[torch.Tensor, ...] = ()

    @property
    def num_groups(self) -> int:
        return len(self.group_block_tables)

    @classmethod
    def from_step_batch(cls, batch: StepBatch, device: torch.device) -> SequenceMetadata:
        packed = batch.packed.to(device, non_blocking=True)
        parts, base = batch.parts, packed.storage_offset()
        # Each field a strided view of the packed copy (explicit strides: a view would give a
        # one-request table a row stride of its width).
        row = lambda name, i=0: packed.as_strided(
            (parts[name][2],), (1,), base + parts[name][0] + i * parts[name][3]
        )
        g, r, w = batch.num_groups, batch.num_reqs, batch.table_width
        tables, _, _, stride = parts["block_tables"]
        group_slot_mappings = tuple(row("slot_mapping", i) for i in range(g))
        group_table_starts = tuple(row("table_starts", i) for i in range(g))
        group_block_tables = tuple(
            packed.as_strided((r, w), (stride, 1), base + tables + i * r * stride) for i in range(g)
        )
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
            token_ids=row("token_ids"),
            positions=row("positions"),
            slot_mapping=group_slot_mappings[0],
            kv_lens=row("lens", 1),
            query_start_loc=row("start_locs"),
            block_tables=group_block_tables[0],
            logits_indices=row("logits_indices"),
            group_slot_mappings=group_slot_mappings,
            group_block_tables=group_block_tables,
            group_table_starts=group_table_starts,
        )
