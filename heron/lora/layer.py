"""LoRALinear: the low-rank updates of one linear layer, for every adapter slot at once."""

from __future__ import annotations

import torch

from heron.kernels import LayerKernels
from heron.layers.linear import Linear, PackedLinear, takes_gemv
from heron.lora.adapter import LoRAPair
from heron.lora.builder import LoRABuilder, LoRAView
from heron.lora.config import LoRAConfig
from heron.metadata import MetadataOperator

# A step of up to this many tokens adds its updates in the base product's launch: one token
# in the GEMV's epilogue (after a shrink launch), more in ``lora_gemv``'s one launch. Either
# replaces the shrink and expand launches, which cost a decode step as much as the products.
_FUSED_TOKENS = 64
# Up to this many slots: ``lora_gemv`` unrolls its update products over the slots.
_FUSED_SLOTS = 16


def shrink_expand(
    kernels: LayerKernels,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    entries: torch.Tensor,
    y: torch.Tensor,
    b_entries: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y + x[t] a[entries[t]]^T b[b_entries[t]]^T`` for each row ``t`` (``a`` [S, R, in],
    ``b`` [S', out, R]; ``b_entries`` None: ``entries``): the Triton kernels (``y`` updated in
    place) or a gather per row."""
    b_entries = entries if b_entries is None else b_entries
    if kernels.lora_shrink is not None:
        return kernels.lora_expand(kernels.lora_shrink(x, a, entries), b, b_entries, y)
    shrunk = torch.bmm(a[entries.long()], x.unsqueeze(2))
    return y + torch.bmm(b[b_entries.long()], shrunk).squeeze(2)


class LoRALinear(MetadataOperator):
    """``y + x A[s]^T B[s]^T`` for each token's slot ``s`` (its group's view says which).

    Slot ``s`` holds one adapter's pairs in fixed-size tables (``lora_a``: ``[slots, parts *
    window, in]``, ``lora_b``: ``[slots, out, parts * window]``, slot 0 zero), so a captured
    graph stays valid whatever the slots hold. A packed layer (qkv, gate_up) keeps each part's
    pair in its own ``window`` rank columns and output rows: one shrink and one expand serve
    every part. The window is ``max_lora_rank`` rounded up to a power of two of at least 16,
    which ``lora_gemv`` reads with whole-row (vectorised) loads; the padding holds zeros."""

    def __init__(self, layer_name: str, base: Linear, config: LoRAConfig) -> None:
        super().__init__(layer_name)
        # Under tensor parallelism a rank holds the base layer's part: its rows of each B
        # (column-parallel) or its columns of each A (row-parallel, the update then summed with
        # the base output's parts).
        # A part: (its first row here, its rows here, the runs of B's rows they are, B's rows).
        if isinstance(base, PackedLinear):
            self.parts = {
                p: (*base.shard_offsets[p], base.shard_rows(p), base.shard_sizes[p])
                for p in base.shard_offsets
            }
        else:
            column = base.parallel == "column"
            rows = base.out_features * (base.tp.size if column else 1)
            self.parts = {
                None: (0, base.out_features, ((base.row_start, base.out_features),), rows)
            }
        self.col_start = base.col_start
        self.in_features, self.out_features = base.in_features, base.out_features
        self.full_in_features = base.in_features * (base.tp.size if base.parallel == "row" else 1)
        self.window = max(16, 1 << (config.max_lora_rank - 1).bit_length())
        width = len(self.parts) * self.window
        slots = config.max_loras + 1
        self.register_buffer(
            "lora_a", torch.zeros(slots, width, self.in_features), persistent=False
        )
        self.register_buffer(
            "lora_b", torch.zeros(slots, self.out_features, width), persistent=False
        )
        self.kernels = base.kernels
        # Each part's first row but the first's, in rank-column order, for ``lora_gemv``: a tile
        # within one part reads its part's rank columns alone (empty: every tile reads all).
        starts = [offset for offset, *_ in self.parts.values()]
        ordered = starts == sorted(starts) and len(starts) <= 3
        self.part_starts = tuple(starts[1:]) if ordered else ()
        self._builder = LoRABuilder(config.max_loras, config.max_lora_rank)
        # The base layer's output rows as reordered after loading (``Linear.reorder_rows``):
        # row i is the checkpoint's row_order[i] (None: the checkpoint's order).
        self.row_order: torch.Tensor | None = None

    def metadata_builder(self) -> LoRABuilder:
        return self._builder

    def check(self, part: str | None, pair: LoRAPair) -> str | None:
        """Why ``pair`` cannot update ``part`` of this layer (None: it can)."""
        if part not in self.parts:
            return f"the layer has no part {part!r}"
        rows = self.parts[part][3]
        if pair.a.shape[1] != self.full_in_features or pair.b.shape[0] != rows:
            return (
                f"lora_A {tuple(pair.a.shape)} / lora_B {tuple(pair.b.shape)} do not fit a "
                f"{self.full_in_features} -> {rows} projection"
            )
        largest = max(pair.a.abs().max().item(), pair.b.abs().max().item())
        if largest > torch.finfo(self.lora_b.dtype).max:  # (kernels read unused slots' B)
            return f"a weight of magnitude {largest:.3g} (scaled) overflows {self.lora_b.dtype}"
        return None

    def set_slot(self, slot: int, pairs: dict[str | None, LoRAPair]) -> None:
        """Slot ``slot`` holds ``pairs`` (by part; parts without one: nothing), as much of
        each as this rank's part of the layer takes."""
        a, b = self.lora_a[slot], self.lora_b[slot]
        a.zero_()
        b.zero_()
        for i, (part, (offset, size, runs, _)) in enumerate(self.parts.items()):
            pair = pairs.get(part)
            if pair is not None:
                cols = slice(i * self.window, i * self.window + pair.a.shape[0])
                a[cols].copy_(pair.a[:, self.col_start : self.col_start + self.in_features])
                b_rows = torch.cat([pair.b[start : start + n] for start, n in runs])
                b[offset : offset + size, cols].copy_(b_rows)
        if self.row_order is not None:
            b.copy_(b[self.row_order])

    def reorder_rows(self, order: torch.Tensor) -> None:
        """Follow the base layer's rows into ``order`` (every slot's B alike)."""
        self.lora_b.copy_(self.lora_b[:, order])
        self.row_order = order if self.row_order is None else self.row_order[order]
        self.part_starts = ()  # (a part's rows are no longer one run)

    def fuses(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether :meth:`product` serves ``x`` (the base layer's ``weight``, in ``x``'s dtype):
        a step with adapters, on the Triton kernels, of one token whose product takes the GEMV,
        or of a few that ``lora_gemv`` takes."""
        rows, k = x.shape
        if (
            self.kernels.lora_shrink is None
            or self.view.token_slots is None
            or not 0 < rows <= _FUSED_TOKENS
            or weight.dtype != x.dtype
            or not takes_gemv(self.kernels, x[:1], weight)  # (x's dtype and the weight's)
        ):
            return False
        return rows == 1 or (
            self.kernels.lora_gemv is not None
            and self.lora_b.shape[0] - 1 <= _FUSED_SLOTS
            and self.kernels.lora_gemv_serves(rows, weight.shape[0], k, x.device, x.element_size())
        )

    def product(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x weight^T (+ bias)`` with the tokens' updates, in the base product's launch."""
        slots = self.view.token_slots
        if x.shape[0] > 1:
            lora = (self.lora_a, self.lora_b, slots, self.part_starts)
            return self.kernels.lora_gemv(x, weight, bias, *lora)
        shrunk = self.kernels.lora_shrink(x, self.lora_a, slots)
        return self.kernels.gemv(x, weight, bias, lora=(shrunk, self.lora_b, slots))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the base layer's output for ``x``) plus each token's update."""
        view: LoRAView = self.view
        if view.token_slots is None:
            return y
        if self.kernels.lora_shrink is not None or view.slots is None:  # (any slot: gathered)
            return shrink_expand(self.kernels, x, self.lora_a, self.lora_b, view.token_slots, y)
        for slot in view.slots:
            rows = (view.token_slots == slot).nonzero().squeeze(1)
            delta = (x[rows] @ self.lora_a[slot].T) @ self.lora_b[slot].T
            y = y.index_add(0, rows, delta)
        return y
