"""Linear layers whose checkpoint shards are packed into one matrix at load time, and their
tensor-parallel forms.

``Linear(parallel="column")`` gives each rank a run of the output features (in units of
``unit_rows``: a head), ``PackedLinear(parallel="column")`` a run of each shard's (each by its
own heads); ``Linear(parallel="row")`` a slice of the input features, and the output is the
all-reduced sum of the ranks' partial products (the bias is added once, by rank 0's copy).
They only take effect inside a tensor-parallel build scope of more than one rank.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from heron.kernels import TORCH_KERNELS, LayerKernels
from heron.layers.fp8 import (
    FP8,
    channel_scales,
    dequantize,
    quantize,
    scale_shape,
    scaled_mm_reference,
)
from heron.layers.wna16 import (
    WNA16Scheme,
    act_order,
    column_part,
    group_width,
    in_act_order,
    wna16_forward,
)
from heron.layers.wna16 import dequantize as dequantize_wna16
from heron.layers.wna16 import quantize as quantize_wna16
from heron.parallel import current_tensor_parallel


class Linear(nn.Module):
    """``y = x W^T (+ b)``; weights load through :meth:`weight_loader`. Decode-sized products
    take the kernel set's GEMV where it serves them (:func:`linear`).

    After :meth:`hold_fp8` or :meth:`quantize_fp8` the weight is FP8 E4M3 with fp32
    ``weight_scale`` (per output channel, or per ``weight_block`` tile): see :func:`fp8_linear`.
    After :meth:`hold_wna16` or :meth:`quantize_wna16` it holds packed integer weights instead
    (``qweight``, ``scales``, ``qzeros``; see ``heron.layers.wna16``) and no ``weight``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        kernels: LayerKernels = TORCH_KERNELS,
        parallel: str | None = None,
        unit_rows: int = 1,
        reduce_output: bool = True,
    ) -> None:
        super().__init__()
        if parallel not in (None, "row", "column"):
            raise ValueError(
                f"a linear layer is row-, column-parallel or not, got parallel={parallel!r}"
            )
        tp = current_tensor_parallel()
        self.tp = tp
        self.parallel = parallel if tp.size > 1 else None
        self.reduce_output = reduce_output  # row-parallel: False leaves the sum to the caller
        self.col_start = 0  # this rank's first input feature (column of the checkpoint's matrix)
        self.row_start = 0  # and output feature (row)
        if self.parallel == "row":
            self.col_start, in_features = tp.part(in_features, "the input features")
        elif self.parallel == "column":
            what = f"the output features' {unit_rows}-row units"
            first, count = tp.part(out_features // unit_rows, what)
            self.row_start, out_features = first * unit_rows, count * unit_rows
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.kernels = kernels
        self.register_parameter("weight_scale", None)
        self.weight_block: tuple[int, int] | None = None
        self.loaded_dtype: torch.dtype | None = None  # quantised to FP8 at load: from this
        # An operator reads the weight as a matrix (MLA's kv_b_proj): under an FP8 scheme it
        # stays in full precision, dequantised after loading from an FP8 checkpoint.
        self.keep_dense = False
        self.wna16: WNA16Scheme | None = None
        for name in ("qweight", "scales", "qzeros", "g_idx", "global_scale"):  # packed weights
            self.register_parameter(name, None)
        self.perm: torch.Tensor | None = None  # act-order: the input columns' order
        self.g_idx_loaded = False  # a packed layer's shards each bring the same g_idx
        # With LoRA: ``lora(x, y)`` adds the adapters' updates to this layer's output y (or
        # ``lora.product`` computes both, the updates in the base product's launch).
        self.lora: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wna16 is not None:
            y = self._packed_product(x)
        elif self.weight_scale is not None:
            y = fp8_linear(
                x, self.weight, self.weight_scale, self.weight_block, self.bias, self.kernels
            )
        elif self.lora is not None and self.lora.fuses(x, self.weight):
            return self._reduced(self.lora.product(x, self.weight, self.bias))
        else:
            y = linear(x, self.weight, self.bias, self.kernels)
        if self.lora is not None:  # (before the sum of a row-parallel layer's parts)
            y = self.lora(x, y)
        return self._reduced(y)

    def _reduced(self, y: torch.Tensor) -> torch.Tensor:
        """The layer's output from this rank's product: summed over the ranks when row-parallel
        (unless its caller sums it, with more)."""
        return self.tp.all_reduce(y) if self.parallel == "row" and self.reduce_output else y

    def hold_fp8(self, block: tuple[int, int] | None) -> None:
        """Empty FP8 weight and scales for a checkpoint to fill: per channel (``block`` None;
        a per-tensor checkpoint's scales repeat over their rows) or per ``block`` tile."""
        n, k = self.weight.shape
        self.weight = _frozen(torch.empty(n, k, dtype=FP8, device=self.weight.device))
        self.weight_scale = _frozen(
            torch.empty(scale_shape(n, k, block), device=self.weight.device)
        )
        self.weight_block = block

    def dequantize_fp8(self, dtype: torch.dtype) -> None:
        """Replace the loaded FP8 weight and scales by the full-precision weight they stand for."""
        w = dequantize(self.weight.data, self.weight_scale.data, self.weight_block)
        self.weight, self.weight_block = _frozen(w.to(dtype)), None
        self.register_parameter("weight_scale", None)

    def quantize_fp8(self, block: tuple[int, int] | None = None) -> None:
        """Replace the loaded full-precision weight by its FP8 quantisation."""
        q, scale = quantize(self.weight.data, block)
        self.loaded_dtype = self.weight.dtype
        self.weight, self.weight_scale, self.weight_block = _frozen(q), _frozen(scale), block

    def hold_wna16(self, scheme: WNA16Scheme) -> None:
        """Empty packed weight, scales, zero points (and ``g_idx``) for a checkpoint in
        ``scheme`` to fill. With ``g_idx`` the scales hold every group of the checkpoint's
        input columns until :meth:`finish_wna16` picks this layer's."""
        n, k = self.out_features, self.in_features
        if k % scheme.pack:
            raise ValueError(f"{k} input features do not fill {scheme.bits}-bit words")
        full_k = k * (self.tp.size if self.parallel == "row" and scheme.act_order else 1)
        groups = -(-full_k // group_width(scheme.group_size, full_k))
        device = self.weight.device
        self.register_parameter("weight", None)
        self.qweight = _frozen(torch.empty(n, k // scheme.pack, dtype=torch.int32, device=device))
        self.scales = _frozen(torch.empty(n, groups, dtype=scheme.scale_dtype, device=device))
        zeros = torch.empty(n, groups, dtype=torch.uint8, device=device)
        self.qzeros = _frozen(zeros) if scheme.zero_points else None
        g_idx = torch.empty(k, dtype=torch.int32, device=device)
        self.g_idx = _frozen(g_idx) if scheme.act_order else None
        global_scale = torch.empty(n, device=device)  # NVFP4: each shard's rows its own
        self.global_scale = _frozen(global_scale) if scheme.fp4 else None
        self.wna16 = scheme

    def finish_wna16(self, dtype: torch.dtype, name: str) -> None:
        """After loading: the act-order layout from ``g_idx`` (columns sorted by group, this
        layer's groups of scales and zero points), or the full-precision weight where an
        operator reads it as a matrix (``keep_dense``)."""
        scheme = self.wna16
        if self.g_idx is not None:
            perm, groups = act_order(self.g_idx.data, scheme.group_size, name)
            packed = [None if t is None else t.data for t in self._packed()]
            qweight, scales, qzeros = in_act_order(*packed, perm, groups, scheme.bits)
            self.qweight, self.scales = _frozen(qweight), _frozen(scales)
            self.qzeros = None if qzeros is None else _frozen(qzeros)
            self.perm, self.g_idx = perm, None
        if self.keep_dense:
            w = dequantize_wna16(*self._packed(), scheme.bits, scheme.group_size, self.global_scale)
            if self.perm is not None:
                w = w[:, torch.argsort(self.perm)]
            self.weight = _frozen(w.to(dtype))
            self.qweight = self.scales = self.qzeros = self.wna16 = self.perm = None
            self.global_scale = None

    def _packed(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(qweight, scales, qzeros)`` of packed integer weights."""
        return self.qweight, self.scales, self.qzeros

    def quantize_wna16(self, scheme: WNA16Scheme) -> None:
        """Replace the loaded full-precision weight by its round-to-nearest quantisation in
        ``scheme`` (dummy weights of a quantised checkpoint's shape)."""
        qweight, scales, qzeros = quantize_wna16(
            self.weight.data, scheme.bits, scheme.group_size, scheme.zero_points, scheme.fp4
        )
        self.register_parameter("weight", None)
        self.qweight, self.qzeros = _frozen(qweight), qzeros if qzeros is None else _frozen(qzeros)
        self.scales = _frozen(scales.to(scheme.scale_dtype))
        if scheme.fp4:  # (scales as they are, in FP8's range)
            self.global_scale = _frozen(torch.ones(self.out_features, device=qweight.device))
        self.wna16 = scheme

    def reorder_rows(self, order: torch.Tensor) -> None:
        """Put the loaded output rows in ``order`` (weight, bias and FP8 scales alike), in
        place (a weight update keeps the tensors graphs read); per block scales need ``order``
        to move whole blocks."""
        if self.wna16 is not None:
            raise ValueError("a row order of packed integer weights is not supported")
        if self.lora is not None:
            self.lora.reorder_rows(order)
        self.weight.data.copy_(self.weight.data[order])
        if self.bias is not None:
            self.bias.data.copy_(self.bias.data[order])
        if self.weight_scale is None:
            return
        if self.weight_block is None:
            self.weight_scale.data.copy_(self.weight_scale.data[order])
            return
        rows = self.weight_block[0]
        blocks = order[::rows] // rows
        whole = (blocks[:, None] * rows + torch.arange(rows, device=order.device)).flatten()
        if not torch.equal(whole, order):  # (a length not whole blocks differs too)
            raise ValueError(f"a row order that splits the {rows}-row blocks of FP8 scales")
        self.weight_scale.data.copy_(self.weight_scale.data[blocks])

    def takes_gemv(self, x: torch.Tensor) -> bool:
        """Whether this layer's product with ``x``'s rows runs as a GEMV that fuses gated
        activations (packed integer weights: their own, but not in act-order, whose input
        columns are reordered; no layer with LoRA, whose updates are added before the
        activation)."""
        if self.lora is not None:
            return False
        if self.wna16 is not None:
            serves = self.kernels.wna16_gemv_serves
            return self.perm is None and serves is not None and x.dim() == 2 and serves(len(x))
        return takes_gemv(self.kernels, x, self.weight)

    def _packed_product(self, x: torch.Tensor, **fused: Any) -> torch.Tensor:
        return wna16_forward(
            x, *self._packed(), self.perm, self.wna16, self.bias, self.kernels,
            self.global_scale, **fused,
        )  # fmt: skip

    def _gemv(self, x: torch.Tensor, **fused: Any) -> torch.Tensor:
        if self.wna16 is not None:
            return self._packed_product(x, **fused)
        if self.weight_scale is None:
            return self.kernels.gemv(x, self.weight, self.bias, **fused)
        return self.kernels.gemv(
            x, self.weight, self.bias, w_scale=self.weight_scale, w_block=self.weight_block, **fused
        )

    def forward_gated(
        self, gate_up: torch.Tensor, act: nn.Module, up: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``self(act(gate_up))`` for a gated activation over ``[gate | up]`` (or, given ``up``
        apart, ``self(act.reference(gate) * up)``); where the product runs as the GEMV, it
        applies the activation as it loads its input (one kernel, no intermediate)."""
        fused = getattr(act, "fused_name", None)
        if fused is not None and self.takes_gemv(gate_up):
            return self._reduced(self._gemv(gate_up, act=fused, up=up))
        return self(act(gate_up) if up is None else act.reference(gate_up) * up)

    def forward_activated(self, x: torch.Tensor, act: nn.Module) -> torch.Tensor:
        """``act(self(x))`` for a gated activation over this layer's ``[gate | up]`` output;
        where the product runs as the GEMV, the activation is its epilogue (one kernel, no
        intermediate)."""
        fused = getattr(act, "fused_name", None)
        if fused is not None and self.takes_gemv(x):
            return self._reduced(self._gemv(x, gated_out=fused))
        return act(self(x))

    def checkpoint_part(
        self, name: str, loaded: torch.Tensor, shard: str | None
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The part of checkpoint tensor ``loaded`` (for parameter ``name``) this rank holds;
        only narrowed, so a lazily read checkpoint tensor reads just that part (runs of rows
        that do not join up come as a tuple). Packed integer tensors are read whole and put in
        the layer's layout first."""
        loaded = self._converted(name, loaded)
        if self.parallel == "row":
            return self._part(name, loaded, None, (self.col_start, self.in_features))
        if self.parallel == "column":
            return self._part(name, loaded, ((self.row_start, self.out_features),), None)
        return loaded

    def _converted(self, name: str, loaded: torch.Tensor) -> torch.Tensor:
        """A packed integer checkpoint tensor in the layer's layout (read whole, if lazily
        read: the layout differs from the file's); others as they are."""
        if self.wna16 is None or name == "bias":
            return loaded
        return self.wna16.convert(name, loaded.load() if hasattr(loaded, "load") else loaded)

    def _part(
        self,
        name: str,
        loaded: torch.Tensor,
        rows: Runs | None,
        cols: tuple[int, int] | None,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The output ``rows`` (runs) and input ``cols`` of the weight that this rank holds, of
        ``loaded`` (the weight, bias or FP8 scales: a per-tensor scale whole, per-channel
        scales by rows, block scales by the blocks of those rows and columns, each whole;
        packed integer tensors converted first, then cut in their units)."""
        if self.wna16 is not None and name != "bias":
            if cols is not None:
                k = self.in_features * self.tp.size
                loaded = column_part(self.wna16, name, loaded, cols, k)
            whole = rows is None or name in ("g_idx", "global_scale")  # one global a matrix
            return loaded if whole else rows_of(loaded, rows)
        if name == "weight_scale":
            if math.prod(loaded.shape) == 1 or (rows is None and self.weight_block is None):
                return loaded
            bn, bk = self.weight_block or (1, 1)
            if cols is not None:
                start, size = whole_blocks(cols, bk, "input columns")
                loaded = loaded.narrow(1, start, size)
            if rows is not None:
                blocks = tuple(whole_blocks(run, bn, "output rows") for run in rows)
                return rows_of(loaded, blocks)
            return loaded
        if cols is not None and name == "weight":
            loaded = loaded.narrow(1, *cols)
        if rows is not None and name in ("weight", "bias"):
            return rows_of(loaded, rows)
        return loaded

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None) -> None:
        if self.parallel == "row" and param is self.bias and self.tp.rank:
            loaded = torch.zeros_like(loaded)  # the all-reduce adds rank 0's bias once
        self._load_rows(param, loaded, 0, self.out_features)

    def _load_rows(self, param: nn.Parameter, loaded: torch.Tensor, start: int, size: int) -> None:
        """Fill output rows ``[start, start + size)`` of ``param`` (the weight, bias or scales;
        act-order ``g_idx``, one for every shard, whole)."""
        if param is self.g_idx:
            if self.g_idx_loaded and not torch.equal(param.data, loaded.to(param.dtype)):
                raise ValueError("g_idx differs from the first shard's (one input order a layer)")
            _copy_checked(param.data, loaded, param)
            self.g_idx_loaded = True
        elif param is not self.weight_scale and param is not self.global_scale:
            _copy_checked(param.data.narrow(0, start, size), loaded, param)
        elif self.weight_block is None:  # per channel; a per-tensor (global) scale repeats
            _copy_checked(param.data.narrow(0, start, size), channel_scales(loaded, size), param)
        else:
            bn = self.weight_block[0]
            if start % bn:
                raise ValueError(
                    f"a shard at row {start} does not start a {bn}-row block of FP8 scales"
                )
            _copy_checked(param.data.narrow(0, start // bn, -(-size // bn)), loaded, param)


class PackedLinear(Linear):
    """Several checkpoint matrices stacked along the output dimension (fused qkv, gate_up).

    ``shards`` maps each checkpoint shard name to its number of output rows, in order. Column-
    parallel, each shard is split over the ranks in units of ``unit_rows[name]`` rows (a head;
    one row by default); a ``shared`` shard of fewer units than ranks (KV heads) gives each
    rank one whole unit, shared with its neighbours.
    """

    def __init__(
        self,
        in_features: int,
        shards: dict[str, int],
        bias: bool = False,
        kernels: LayerKernels = TORCH_KERNELS,
        parallel: str | None = None,
        unit_rows: dict[str, int] | None = None,
        shared: tuple[str, ...] = (),
    ) -> None:
        if parallel not in (None, "column"):
            raise ValueError(
                f"a packed linear layer is column-parallel or not, got parallel={parallel!r}"
            )
        tp = current_tensor_parallel()
        sharded = parallel == "column" and tp.size > 1
        self.shard_starts: dict[str, int] = {}  # each shard's first row in its checkpoint tensor
        self.shard_sizes = dict(shards)  # and its rows there
        local = {}
        for name, rows in shards.items():
            if sharded:
                unit = (unit_rows or {}).get(name, 1)
                what = f"the {name} shard's {unit}-row units"
                first, count = tp.part(rows // unit, what, shared=name in shared)
                self.shard_starts[name], local[name] = first * unit, count * unit
            else:
                self.shard_starts[name], local[name] = 0, rows
        super().__init__(in_features, sum(local.values()), bias, kernels)
        self.parallel = parallel if tp.size > 1 else None
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in local.items():
            self.shard_offsets[name] = (start, size)
            start += size

    def checkpoint_part(
        self, name: str, loaded: torch.Tensor, shard: str | None
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        loaded = self._converted(name, loaded)
        if self.parallel is None or shard not in self.shard_offsets:
            return loaded
        return self._part(name, loaded, self.shard_rows(shard), None)

    def shard_rows(self, shard: str) -> Runs:
        """The runs of checkpoint shard ``shard``'s rows that this rank holds."""
        return ((self.shard_starts[shard], self.shard_offsets[shard][1]),)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None) -> None:
        if shard not in self.shard_offsets:
            raise ValueError(f"unknown shard {shard!r}; expected one of {list(self.shard_offsets)}")
        self._load_rows(param, loaded, *self.shard_offsets[shard])


#: ``(start, length)`` runs of a tensor's rows.
Runs = tuple[tuple[int, int], ...]


def rows_of(loaded: torch.Tensor, runs: Runs) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """``loaded``'s rows in ``runs``, only narrowed: one tensor where the runs join up, else a
    tuple of runs, which the loader reads and joins."""
    merged: list[tuple[int, int]] = []
    for start, length in runs:
        if merged and sum(merged[-1]) == start:
            merged[-1] = (merged[-1][0], merged[-1][1] + length)
        else:
            merged.append((start, length))
    parts = tuple(loaded.narrow(0, start, length) for start, length in merged)
    return parts[0] if len(parts) == 1 else parts


def whole_blocks(run: tuple[int, int], block: int, what: str) -> tuple[int, int]:
    """The run of FP8 scale blocks covering a rank's ``run`` of rows or columns, which must
    be whole blocks (every rank's run is as long, so all ranks refuse alike)."""
    start, length = run
    if start % block or length % block:
        raise ValueError(
            f"tensor parallelism gives each rank {length} {what}, which splits the "
            f"{block}-wide blocks of its FP8 scales"
        )
    return start // block, length // block


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    kernels: LayerKernels = TORCH_KERNELS,
) -> torch.Tensor:
    """``x W^T (+ b)``; decode-sized batches take the kernel set's memory-bound GEMV where it
    serves them (on a GPU it beats cuBLAS there, most on narrow outputs such as o_proj and
    down_proj)."""
    if takes_gemv(kernels, x, weight):
        return kernels.gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def fp8_linear(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] | None,
    bias: torch.Tensor | None = None,
    kernels: LayerKernels = TORCH_KERNELS,
) -> torch.Tensor:
    """``x (q * scale)^T (+ b)`` for an FP8 weight: the GEMV (scales in its epilogue, or per
    tile for blocks) for few rows; FP8 tensor cores (``kernels.fp8_mm``) for more rows of a
    per-channel weight, which the torch set emulates in half precision (the CPU's bf16 figures
    are the GPU's); else the dequantised weight (block-wise weights past the GEMV, and fp32 on
    the torch set: the format's exact reference)."""
    if takes_gemv(kernels, x, q):
        return kernels.gemv(x, q, bias, w_scale=scale, w_block=block)
    n, k = q.shape
    if block is None and x.dim() == 2 and n % 16 == k % 16 == 0:
        if kernels.fp8_mm is not None:
            return kernels.fp8_mm(x, q, scale, bias)
        if x.dtype in _GEMV_DTYPES:
            return scaled_mm_reference(x, q, scale, bias)
    return F.linear(x, dequantize(q, scale, block).to(x.dtype), bias)


_GEMV_DTYPES = (torch.bfloat16, torch.float16)


def takes_gemv(kernels: LayerKernels, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x`` times ``weight`` goes to the kernel set's GEMV: few rows (its ``serves``
    says how few), in half precision, where the kernel is faster than the vendor GEMM."""
    return (
        kernels.gemv is not None
        and x.dim() == 2
        and x.dtype in _GEMV_DTYPES
        and kernels.gemv_serves(x.shape[0], *weight.shape, x.device, weight.dtype == FP8)
    )


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def _copy_checked(target: torch.Tensor, loaded: torch.Tensor, param: nn.Parameter) -> None:
    if target.shape != loaded.shape:
        raise ValueError(
            f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit a parameter slice of "
            f"shape {tuple(target.shape)} (parameter {tuple(param.shape)})"
        )
    target.copy_(loaded)
