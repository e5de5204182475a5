"""Per-step shared metadata: the host-side StepBatch and the device-side SequenceMetadata."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import numpy as np
import torch

from heron.metadata.errors import StepMetadataError
from heron.metadata.parts import GroupLayout, Part

_Record = TypeVar("_Record")

# Every array (and every block-table row) of the packed batch starts on a multiple of this many
# int32s (64 bytes). Triton compiles a kernel once per pattern of pointer alignments and of
# integer arguments divisible by 16 (a table's row stride): arrays at step-dependent offsets
# would have it compile new variants in the middle of a run.
_ALIGN = 16


def _padded(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class _Offset(NamedTuple):
    start: int
    rows: int | None  # None: one 1-D row
    cols: int
    stride: int


@functools.lru_cache(maxsize=256)
def _layout(
    num_reqs: int,
    num_tokens: int,
    num_logits: int,
    groups: tuple[GroupLayout, ...],
    adapters: bool = False,
) -> tuple[dict[str, _Offset], tuple[dict[str, _Offset], ...], int]:
    """The shared parts' and each group's parts' places in the packed array, and its size.

    Parts follow one another, each row on its own 16-element boundary. Decode steps repeat the
    same dimensions, so layouts are cached.
    """
    shared = (
        Part("start_locs", num_reqs + 1, 2),
        Part("lens", num_reqs, 2),
        Part("token_ids", num_tokens),
        Part("positions", num_tokens),
        Part("logits_indices", num_logits),
    ) + ((Part("adapter_slots", num_reqs),) if adapters else ())
    start = 0

    def place(parts: tuple[Part, ...]) -> dict[str, _Offset]:
        nonlocal start
        offsets = {}
        for name, cols, rows in parts:
            offsets[name] = _Offset(start, rows, cols, _padded(cols))
            start += (rows or 1) * _padded(cols)
        return offsets

    return place(shared), tuple(place(group.parts) for group in groups), start


class StepBatch:
    """One step's batch on the host, laid out in a single packed int32 array.

    The runner writes token ids, positions, per-request query/KV lengths and the rows to
    compute logits for into the shared views (with ``adapters``, each row's LoRA adapter slot
    too); each cache group's kind writes its own parts (``group_parts[g]``, by name;
    ``groups[g]`` is their layout). :meth:`finish` fills both
    cumulative-length arrays with one cumsum over the stacked lengths. The packed array then
    travels to the device in one copy (:meth:`SequenceMetadata.from_step_batch`).

    Every array (and every row of a 2-D one) starts at a multiple of 16 elements, so the device
    tensors' alignments and row strides do not change from step to step (a table's row stride
    is its width rounded up to 16).
    """

    def __init__(
        self,
        num_reqs: int,
        num_tokens: int,
        num_logits: int,
        block_size: int,
        groups: Sequence[GroupLayout],
        staging: torch.Tensor | None = None,
        adapters: bool = False,
    ) -> None:
        self.num_reqs, self.num_tokens = num_reqs, num_tokens
        self.num_logits, self.block_size = num_logits, block_size
        self.groups = tuple(groups)
        shared, self.group_offsets, total = _layout(
            num_reqs, num_tokens, num_logits, self.groups, adapters
        )
        self.offsets = shared
        # A reused (pinned) host buffer, so that the copy to a GPU is one asynchronous DMA.
        self.packed = torch.empty(total, dtype=torch.int32) if staging is None else staging[:total]
        flat = self.packed.numpy()
        # Zeroed by numpy, on this thread: a PyTorch fill of a long batch fans out to every core,
        # and waits for all of them on a busy or virtualised host.
        flat.fill(0)

        def view(offset: _Offset) -> np.ndarray:
            start, rows, cols, stride = offset
            if rows is None:
                return flat[start : start + cols]
            return flat[start : start + rows * stride].reshape(rows, stride)[:, :cols]

        self.start_locs = view(shared["start_locs"])
        self.lens = view(shared["lens"])
        self.query_lens, self.kv_lens = self.lens[0], self.lens[1]
        self.token_ids = view(shared["token_ids"])
        self.positions = view(shared["positions"])
        self.logits_indices = view(shared["logits_indices"])
        self.adapter_slots = view(shared["adapter_slots"]) if adapters else None
        self.group_parts = [
            {name: view(offset) for name, offset in offsets.items()}
            for offsets in self.group_offsets
        ]

    @classmethod
    def packed_size(
        cls,
        num_reqs: int,
        num_tokens: int,
        num_logits: int,
        groups: Sequence[GroupLayout],
        adapters: bool = False,
    ) -> int:
        """Elements of the packed array for these dimensions."""
        return _layout(num_reqs, num_tokens, num_logits, tuple(groups), adapters)[2]

    def finish(self) -> None:
        """Compute the cumulative query and KV lengths (one cumsum over both)."""
        np.cumsum(self.lens, axis=1, out=self.start_locs[:, 1:])


@dataclass(frozen=True)
class SequenceMetadata:
    """The step's sequence facts on the device, built once per step from a :class:`StepBatch`.

    Builders derive their groups' views from this; operators never read it directly.
    Host copies of the lengths are kept for eager kernels that loop over requests. Each cache
    group's own parts are one typed record per group (:meth:`parts`).
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
    kv_lens: torch.Tensor
    query_start_loc: torch.Tensor
    logits_indices: torch.Tensor
    group_parts: tuple[object, ...] = ()  # per cache group: its kind's record of device views
    # per request, the proposals after its last token that the step verifies (None: no row
    # verifies any); a kind whose state cannot be cut back keeps what each of them left
    num_proposed_host: np.ndarray | None = None
    # per request, its LoRA adapter's slot (0: none), on the device and the host; None: the
    # engine serves no adapters
    adapter_slots: torch.Tensor | None = None
    adapter_slots_host: np.ndarray | None = None
    # per token, the last position it attends to (int32), where some token sees past itself
    # (a Gemma 3 image's tokens see the whole image); None: every token is causal
    key_limits: torch.Tensor | None = None

    @property
    def num_groups(self) -> int:
        return len(self.group_parts)

    @property
    def is_uniform_verification(self) -> bool:
        """Every row verifies the same number of proposals after its last token: the steps
        that verification graphs replay, which a builder of ``UNIFORM`` support runs eagerly
        alike."""
        proposed = self.num_proposed_host
        return (
            proposed is not None
            and self.num_tokens == self.num_reqs * self.max_query_len
            and bool((proposed == self.max_query_len - 1).all())
        )

    def parts(self, group: int, record: type[_Record]) -> _Record:
        """Cache group ``group``'s parts, which must be of the kind whose record is ``record``."""
        if group >= self.num_groups:
            raise StepMetadataError(
                f"cache group {group} was asked for, the step has {self.num_groups}"
            )
        parts = self.group_parts[group]
        if type(parts) is not record:
            raise StepMetadataError(
                f"cache group {group} carries {type(parts).__name__}, not {record.__name__}"
            )
        return parts

    @classmethod
    def from_step_batch(cls, batch: StepBatch, device: torch.device) -> SequenceMetadata:
        packed = batch.packed.to(device, non_blocking=True)
        base = packed.storage_offset()

        # Each part a strided view of the packed copy (explicit strides: a view would give a
        # one-request table a row stride of its width).
        def view(offset: _Offset, row: int | None = None) -> torch.Tensor:
            start, rows, cols, stride = offset
            if rows is None or row is not None:  # a 1-D part, or one row of a 2-D one
                return packed.as_strided((cols,), (1,), base + start + (row or 0) * stride)
            return packed.as_strided((rows, cols), (stride, 1), base + start)

        shared = batch.offsets
        group_parts = tuple(
            group.record(**{name: view(offset) for name, offset in offsets.items()})
            for group, offsets in zip(batch.groups, batch.group_offsets)
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
            token_ids=view(shared["token_ids"]),
            positions=view(shared["positions"]),
            kv_lens=view(shared["lens"], 1),
            query_start_loc=view(shared["start_locs"], 0),
            logits_indices=view(shared["logits_indices"]),
            group_parts=group_parts,
            adapter_slots=None if batch.adapter_slots is None else view(shared["adapter_slots"]),
            adapter_slots_host=batch.adapter_slots,
        )
