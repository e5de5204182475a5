"""Sparse mixture-of-experts: a bank of gated-MLP experts, and the block that routes to them.

An ``ExpertBank`` stacks ``num_experts`` MLPs in the layout its checkpoints use; its two kinds
differ only in layout and activation, which ``heron.kernels.moe.fused_experts`` takes as
switches:

- ``SwiGLUExperts``: ``down(silu(gate(x)) * up(x))`` without biases, stored as HF transformers
  stacks them (``gate_up_proj`` [E, 2I, hidden] as ``[gate | up]``, ``down_proj`` [E, hidden,
  I]); checkpoints holding one tensor per expert (``experts.{e}.gate_proj.weight``) load into
  the stacks through :meth:`ExpertBank.weight_loader` (Qwen-MoE, Qwen3-Next/3.5, DeepSeek).
  They may hold FP8 weights (``hold_fp8`` / ``quantize_fp8``, as ``Linear`` does) or packed
  integers (GPTQ, AWQ, compressed-tensors: ``hold_wna16`` / ``quantize_wna16``);
- ``ClampedSwiGLUExperts``: gpt-oss's, with biases, input-major, gate and up interleaved;
  or, after ``hold_mxfp4``, MXFP4 stacks as its published checkpoints store them.

With the Triton kernel set the experts run as two fused grouped GEMMs, with no host sync, in
eager steps and CUDA graphs alike. Otherwise they run the reference in plain PyTorch, which
loops over the experts: correct and readable but not fast.

``SparseMoE`` is router -> experts, plus an optional shared expert (Qwen's is scaled by a
sigmoid gate, DeepSeek's is not); tensor-parallel, one all-reduce sums both. Its submodules carry HF's Qwen-MoE names (``gate``,
``experts``, ``shared_expert``, ``shared_expert_gate``); a family whose checkpoints name them
otherwise maps the names with its model's ``checkpoint_renames``.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from heron.kernels import TORCH_KERNELS, LayerKernels
from heron.layers.activation import SiluAndMul
from heron.layers.fp8 import FP8, channel_scales, dequantize, quantize, scale_shape
from heron.layers.linear import Linear, whole_blocks
from heron.layers.mlp import GatedMLP
from heron.layers.mxfp4 import BLOCK, dequantize_mxfp4, packed_shapes
from heron.layers.routing import Routing, TopKRouter
from heron.layers.wna16 import WNA16Scheme, act_order, column_part, group_width, in_act_order
from heron.layers.wna16 import dequantize as dequantize_wna16
from heron.layers.wna16 import quantize as quantize_wna16
from heron.parallel import current_tensor_parallel

#: An FP8 stack's scales are the parameter of its name plus this (``gate_up_proj_scale``).
SCALE_SUFFIX = "_scale"
#: A packed integer stack's tensors (``gate_up_proj_qweight``; ``heron.layers.wna16``'s names).
PACKED_TENSORS = ("qweight", "scales", "qzeros", "g_idx")
#: ``fused_experts``' arguments from an MXFP4 bank's parameters.
_MXFP4_ARGS = {
    "gate_up": "gate_up_proj_blocks",
    "down": "down_proj_blocks",
    "gate_up_scale": "gate_up_proj_scales",
    "down_scale": "down_proj_scales",
}


def _stacked(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's SwiGLU over ``gate_up`` [..., 2I] whose gate and up columns alternate.

    The gate is clamped from above and the up projection on both sides, so that outliers
    cannot blow up the product; ``up + 1`` keeps a path through the unit when ``up`` is zero.
    """
    gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(alpha * gate))


class ExpertBank(nn.Module):
    """``num_experts`` gated MLPs; ``forward(x, weights, indices, add, add_gate)`` sums each
    token's experts ``indices`` [T, k] weighted by ``weights`` [T, k], plus ``add`` (a shared
    expert's output; times ``sigmoid(add_gate)`` if given), which the fused kernels add in
    the same launch as the sum.

    A subclass creates the stacked parameters ``gate_up_proj`` and ``down_proj`` (and any
    biases), says how the fused kernels read them (the class attributes below, see
    ``heron.kernels.moe``) and how one expert computes (``expert``, the reference).
    ``per_expert_names`` maps a per-expert checkpoint module (``gate_proj``) to the stacked
    parameter and the part of it that it fills.
    """

    activation: str
    output_major: bool
    interleaved: bool
    per_expert_names: dict[str, tuple[str, str]] = {}

    def __init__(self, num_experts: int, intermediate_size: int, kernels: LayerKernels) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.fused = kernels.fused_experts
        tp = current_tensor_parallel()
        # Tensor-parallel inside the experts: each rank holds every expert's intermediate
        # features [inter_start, inter_start + intermediate_size); the block sums the ranks.
        self.tp = tp if tp.size > 1 else None
        self.inter_start, self.intermediate_size = (
            tp.part(intermediate_size, "the experts' intermediate size")
            if self.tp
            else (0, intermediate_size)
        )

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` applied to the rows of ``x`` [n, hidden]."""
        raise NotImplementedError

    def fused_layout(self) -> dict:
        """``fused_experts``' weight and layout arguments for this bank."""
        return dict(
            gate_up=self.gate_up_proj,
            down=self.down_proj,
            activation=self.activation,
            output_major=self.output_major,
            interleaved=self.interleaved,
        )

    def forward(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        indices: torch.Tensor,
        add: torch.Tensor | None = None,
        add_gate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.fused is not None:
            return self.fused(
                x, weights, indices, **self.fused_layout(), add=add, add_gate=add_gate
            )
        out = self.forward_sparse(x, weights, indices)
        if add is None:
            return out
        return out + (add if add_gate is None else torch.sigmoid(add_gate) * add)

    def forward_sparse(
        self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor
    ) -> torch.Tensor:
        """The reference: each expert runs only on the tokens routed to it.

        The per-expert token counts are read on the host (one sync per call), so a CUDA graph
        cannot capture this path.
        """
        top_k = indices.shape[1]
        flat = indices.flatten()
        # (token, slot) pairs grouped by expert; a stable sort keeps tokens in order.
        order = torch.argsort(flat, stable=True)
        tokens = order // top_k
        pair_weights = weights.flatten()[order]
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n:
                rows = tokens[start : start + n]
                y = self.expert(e, x[rows]) * pair_weights[start : start + n, None]
                out.index_add_(0, rows, y.to(x.dtype))
            start += n
        return out

    def checkpoint_part(
        self, name: str, loaded: torch.Tensor, shard: tuple[int, str] | None
    ) -> torch.Tensor:
        """This rank's intermediate features of a checkpoint tensor, only narrowed (a stacked
        tensor that interleaves the rank's rows with others' is cut in :meth:`weight_loader`)."""
        if self.tp is None:
            return loaded
        dim = self._intermediate_dim(name, shard)
        if dim is None:
            return loaded
        width = self._intermediate_width(name)
        return loaded.narrow(dim, width * self.inter_start, width * self.intermediate_size)

    def _intermediate_dim(self, name: str, shard: tuple[int, str] | None) -> int | None:
        """The dimension of checkpoint tensor ``name`` (or its per-expert ``shard``) that runs
        over intermediate features; None if none does or it cannot be narrowed at once."""
        raise NotImplementedError

    def _intermediate_width(self, name: str) -> int:
        """How many entries of that dimension one intermediate feature takes."""
        return 1

    def checkpoint_shards(self, param_name: str) -> set[tuple[int, str]]:
        """The per-expert pieces that together fill ``param_name`` (a stack, its scales or its
        packed tensors)."""
        parts = {p for target, p in self.per_expert_names.values() if param_name.startswith(target)}
        return {(e, part) for e in range(self.num_experts) for part in parts}

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple[int, str] | None
    ) -> None:
        """Copy a whole stacked tensor (``shard`` None) or one expert's piece of it."""
        if shard is not None and not 0 <= shard[0] < self.num_experts:
            raise ValueError(f"expert {shard[0]} is out of range for {self.num_experts} experts")
        target = param.data if shard is None else self._piece(param.data, *shard)
        if target.shape != loaded.shape:
            raise ValueError(
                f"expert tensor of shape {tuple(loaded.shape)} does not fit {tuple(target.shape)}"
            )
        target.copy_(loaded)

    def _piece(self, stacked: torch.Tensor, expert: int, part: str) -> torch.Tensor:
        raise NotImplementedError


class SwiGLUExperts(ExpertBank):
    """``down(silu(gate(x)) * up(x))`` experts without biases, in HF's stacked layout
    (``gate_up_proj`` [E, 2I, hidden] as ``[gate | up]``, ``down_proj`` [E, hidden, I]).

    After :meth:`hold_fp8` or :meth:`quantize_fp8` both stacks are FP8 E4M3 with fp32 scales
    ``gate_up_proj_scale`` and ``down_proj_scale``: per output channel ([E, 2I], [E, hidden])
    or per ``weight_block`` tile, where the gate's rows of tiles and the up's are kept apart
    ([E, 2 cdiv(I, bn), cdiv(hidden, bk)]) so that an ``I`` of part-blocks stacks as published.

    After :meth:`hold_wna16` or :meth:`quantize_wna16` each stack is packed integers in
    ``heron.layers.wna16``'s layout, every expert's matrix as a packed ``Linear`` holds it:
    ``gate_up_proj_qweight`` int32 [E, 2I, hidden * bits / 32], ``gate_up_proj_scales`` and
    ``gate_up_proj_qzeros`` (uint8, or None when symmetric) [E, 2I, groups of hidden], and
    down's alike; the dense stacks are None.
    """

    activation, output_major, interleaved = "swiglu", True, False
    per_expert_names = {
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
        "down_proj": ("down_proj", "down"),
    }
    #: How many matrices each stack holds along its rows (gate and up; down).
    _matrices = {"gate_up_proj": 2, "down_proj": 1}

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        kernels: LayerKernels = TORCH_KERNELS,
    ) -> None:
        super().__init__(num_experts, intermediate_size, kernels)
        inter = self.intermediate_size
        self.gate_up_proj = _stacked(num_experts, 2 * inter, hidden_size)
        self.down_proj = _stacked(num_experts, hidden_size, inter)
        self.register_parameter("gate_up_proj_scale", None)
        self.register_parameter("down_proj_scale", None)
        self.weight_block: tuple[int, int] | None = None
        self.whole_intermediate = intermediate_size  # (all ranks')
        self.wna16: WNA16Scheme | None = None
        self.input_perm: torch.Tensor | None = None  # act-order packed experts: x's columns

    def hold_fp8(self, block: tuple[int, int] | None) -> None:
        """Empty FP8 stacks and scales for an FP8 checkpoint to fill: per channel (``block``
        None; a per-tensor checkpoint's scales repeat over their rows) or per ``block`` tile."""
        for name, count in self._matrices.items():
            stack = getattr(self, name)
            e, n, k = stack.shape
            tiles = scale_shape(n // count, k, block)
            q = torch.empty(e, n, k, dtype=FP8, device=stack.device)
            scale = torch.empty(e, count * tiles[0], *tiles[1:], device=stack.device)
            setattr(self, name, _frozen(q))
            setattr(self, name + SCALE_SUFFIX, _frozen(scale))
        self.weight_block = block

    def quantize_fp8(self, block: tuple[int, int] | None = None) -> None:
        """Replace the loaded full-precision stacks by their FP8 quantisation, each expert's
        gate, up and down matrix on its own."""
        for name, count in self._matrices.items():
            experts = [
                [quantize(w, block) for w in stack.chunk(count)] for stack in getattr(self, name)
            ]
            q = torch.stack([torch.cat([q for q, _ in parts]) for parts in experts])
            scale = torch.stack([torch.cat([s for _, s in parts]) for parts in experts])
            setattr(self, name, _frozen(q))
            setattr(self, name + SCALE_SUFFIX, _frozen(scale))
        self.weight_block = block

    def hold_wna16(self, scheme: WNA16Scheme) -> None:
        """Empty packed stacks for a checkpoint in ``scheme`` to fill, with each matrix's
        ``g_idx`` ([E, 2 hidden]: the gate's then the up's; [E, I]) until
        :meth:`finish_wna16` has used it."""
        if scheme.fp4:
            raise ValueError(f"{scheme.format} nvfp4 MoE experts are not supported")
        for name, count in self._matrices.items():
            e, n, k = getattr(self, name).shape
            if k % scheme.pack:
                raise ValueError(f"{name}: {k} input features do not fill {scheme.bits}-bit words")
            groups = -(-k // group_width(scheme.group_size, k))
            device = getattr(self, name).device
            self.register_parameter(name, None)
            layouts = {  # (shape after the expert dimension, dtype, held)
                "qweight": ((n, k // scheme.pack), torch.int32, True),
                "scales": ((n, groups), scheme.scale_dtype, True),
                "qzeros": ((n, groups), torch.uint8, scheme.zero_points),
                "g_idx": ((count * k,), torch.int32, scheme.act_order),
            }
            for leaf, (shape, dtype, held) in layouts.items():
                t = _frozen(torch.empty(e, *shape, dtype=dtype, device=device)) if held else None
                self.register_parameter(f"{name}_{leaf}", t)
        self.wna16 = scheme

    def finish_wna16(self, name: str) -> None:
        """After loading: each matrix's ``g_idx`` used, then dropped. Act-order experts (GPTQ's
        ``desc_act``) get their columns sorted by group, as a packed ``Linear``'s are: gate's and
        up's (one order, of their shared input) by ``input_perm`` [E, hidden], by which the
        kernels gather ``x``; down's folded into gate's and up's rows, so that their product
        comes out in down's order. A rank of tensor parallelism takes them in order only."""
        gate_up, down = self.gate_up_proj_g_idx, self.down_proj_g_idx
        if gate_up is None:
            return
        self.register_parameter("gate_up_proj_g_idx", None)
        self.register_parameter("down_proj_g_idx", None)
        gate, up = gate_up.view(gate_up.shape[0], 2, -1).unbind(1)
        if not torch.equal(gate, up):
            raise ValueError(f"{name}: an expert's gate_proj and up_proj g_idx differ")
        bits, group, inter = self.wna16.bits, self.wna16.group_size, down.shape[1]
        if self.tp is not None:  # (down's scales were cut as if in order)
            cols = torch.arange(max(gate.shape[1], self.whole_intermediate), device=down.device)
            down_cols = cols[self.inter_start : self.inter_start + inter]
            if not (
                (gate == cols[: gate.shape[1]] // group_width(group, gate.shape[1])).all()
                and (down == down_cols // group_width(group, self.whole_intermediate)).all()
            ):
                raise ValueError(
                    f"{name}: act-order (desc_act) g_idx on MoE experts under tensor "
                    "parallelism is not supported"
                )
            return
        perms = []
        for e in range(self.num_experts):
            perm_in, groups_in = act_order(gate[e], group, f"{name}.{e}.gate_proj")
            perm_h, groups_h = act_order(down[e], group, f"{name}.{e}.down_proj")
            gu = in_act_order(*self._packed("gate_up_proj", e), perm_in, groups_in, bits)
            if perm_h is not None:  # gate's and up's rows in down's column order
                rows = torch.cat([perm_h, perm_h + inter])
                gu = tuple(None if t is None else t[rows] for t in gu)
            dn = in_act_order(*self._packed("down_proj", e), perm_h, groups_h, bits)
            for stack, tensors in (("gate_up_proj", gu), ("down_proj", dn)):
                for held, t in zip(self._packed(stack, e), tensors, strict=True):
                    if held is not None:
                        held.copy_(t)
            perms.append(perm_in)
        if any(p is not None for p in perms):
            whole = torch.arange(gate.shape[1], device=gate.device)
            order = [whole if p is None else p for p in perms]
            self.input_perm = torch.stack(order).to(torch.int32)

    def quantize_wna16(self, scheme: WNA16Scheme) -> None:
        """Replace the loaded full-precision stacks by each expert's round-to-nearest
        quantisation in ``scheme`` (dummy weights of a quantised checkpoint's shape)."""
        dense = {name: getattr(self, name).data for name in self._matrices}
        self.hold_wna16(replace(scheme, act_order=False))
        for name, stack in dense.items():
            for e, w in enumerate(stack):
                packed = quantize_wna16(w, scheme.bits, scheme.group_size, scheme.zero_points)
                for leaf, t in zip(PACKED_TENSORS, packed):
                    if t is not None:
                        getattr(self, f"{name}_{leaf}")[e] = t

    def _packed(self, name: str, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Expert ``e``'s ``(qweight, scales, qzeros)`` of packed stack ``name``."""
        zeros = getattr(self, f"{name}_qzeros")
        return (
            getattr(self, f"{name}_qweight")[e],
            getattr(self, f"{name}_scales")[e],
            None if zeros is None else zeros[e],
        )

    def weights_of(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ``e``'s ``[gate | up]`` and down matrices in ``dtype`` (dequantised if FP8
        or packed)."""
        if self.wna16 is not None:
            bits, group = self.wna16.bits, self.wna16.group_size
            gate_up, down = (
                dequantize_wna16(*self._packed(n, e), bits, group) for n in self._matrices
            )
            return gate_up.to(dtype), down.to(dtype)
        out = []
        for name, count in self._matrices.items():
            w, scale = getattr(self, name)[e], getattr(self, name + SCALE_SUFFIX)
            if scale is not None:
                parts = zip(w.chunk(count), scale[e].chunk(count), strict=True)
                w = torch.cat([dequantize(q, s, self.weight_block) for q, s in parts])
            out.append(w.to(dtype))
        return out[0], out[1]

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.weights_of(e, x.dtype)  # (as held: act-order's columns sorted)
        if self.input_perm is not None:
            x = x.index_select(-1, self.input_perm[e])
        gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, down)

    def fused_layout(self) -> dict:
        if self.wna16 is not None:
            packed = {
                f"{arg}{suffix}": getattr(self, f"{arg}_proj_{leaf}")
                for arg in ("gate_up", "down")
                for suffix, leaf in (("", "qweight"), ("_scale", "scales"), ("_zeros", "qzeros"))
            }
            layout = dict(activation=self.activation, output_major=True, interleaved=False)
            scheme = dict(bits=self.wna16.bits, group_size=self.wna16.group_size)
            return packed | layout | scheme | dict(input_perm=self.input_perm)
        layout = super().fused_layout()
        if self.gate_up_proj_scale is None:
            return layout
        return layout | dict(
            gate_up_scale=self.gate_up_proj_scale,
            down_scale=self.down_proj_scale,
            scale_block=self.weight_block,
        )

    def checkpoint_part(
        self, name: str, loaded: torch.Tensor, shard: tuple[int, str] | None
    ) -> torch.Tensor:
        """As for the weights; an expert's scales follow its rank's rows (gate, up) or
        columns (down) in whole tiles, and per-tensor and down's per-channel ones are whole.
        Packed integer tensors are read whole and put in the held layout first."""
        if self.wna16 is not None and name.rpartition("_proj_")[2] in PACKED_TENSORS:
            return self._packed_part(name.rpartition("_proj_")[2], loaded, shard)
        if self.tp is None or not name.endswith(SCALE_SUFFIX) or shard is None:
            return super().checkpoint_part(name, loaded, shard)
        dim = self._intermediate_dim(name, shard)
        run = (self.inter_start, self.intermediate_size)
        if math.prod(loaded.shape) == 1 or (self.weight_block is None and dim == 1):
            return loaded
        if self.weight_block is not None:
            run = whole_blocks(run, self.weight_block[dim], "intermediate features")
        return loaded.narrow(dim, *run)

    def _packed_part(self, leaf: str, loaded: torch.Tensor, shard: tuple[int, str]) -> torch.Tensor:
        """One expert's packed tensor ``leaf`` converted, then this rank's part of it: gate's
        and up's rows, down's input columns in whole words and groups (a split inside one is
        refused naming the tensor). A rank's ``g_idx`` must keep the columns in order
        (:meth:`finish_wna16` refuses others), so down's groups are cut as if it were absent."""
        converted = self.wna16.convert(leaf, loaded.load() if hasattr(loaded, "load") else loaded)
        if self.tp is None:
            return converted
        run = (self.inter_start, self.intermediate_size)
        if shard[1] == "down":
            in_order = replace(self.wna16, act_order=False)
            return column_part(in_order, leaf, converted, run, self.whole_intermediate)
        return converted if leaf == "g_idx" else converted.narrow(0, *run)

    def _intermediate_dim(self, name: str, shard: tuple[int, str] | None) -> int | None:
        if shard is not None:  # gate_proj, up_proj [I, hidden]; down_proj [hidden, I]
            return 1 if shard[1] == "down" else 0
        return 2 if name == "down_proj" else None  # a stacked [gate | up] is cut on load

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple[int, str] | None
    ) -> None:
        if self.tp is not None and shard is None and param is self.gate_up_proj:
            whole = loaded.shape[1] // 2
            start, size = self.inter_start, self.intermediate_size
            gate, up = loaded.narrow(1, start, size), loaded.narrow(1, whole + start, size)
            loaded = torch.cat([gate, up], dim=1)
        scales = param is self.gate_up_proj_scale or param is self.down_proj_scale
        if scales and shard is not None and self.weight_block is None:  # per channel
            loaded = channel_scales(loaded, self._piece(param.data, *shard).shape[0])
        super().weight_loader(param, loaded, shard)

    def _piece(self, stacked: torch.Tensor, expert: int, part: str) -> torch.Tensor:
        half = stacked.shape[1] // 2  # the gate's rows (of weights, channels or tiles)
        if part == "gate":
            return stacked[expert, :half]
        if part == "up":
            return stacked[expert, half:]
        return stacked[expert]


class ClampedSwiGLUExperts(ExpertBank):
    """gpt-oss's experts: two-layer MLPs with biases and the clamped SwiGLU, stored as its
    checkpoints store them.

    The weights are input-major (``y = x @ W + b``): ``gate_up_proj`` [E, hidden, 2I] with gate
    and up columns interleaved, ``down_proj`` [E, I, hidden]. Parameter names equal the
    checkpoint's, so the generic loader fills them.

    After :meth:`hold_mxfp4` the bank holds MXFP4 stacks under a published checkpoint's names
    and in its layout (``heron.layers.mxfp4``): ``gate_up_proj_blocks`` [E, 2I, hidden / 32, 16]
    and ``gate_up_proj_scales`` (output-major, gate and up rows alternating), ``down_proj_blocks``
    [E, hidden, I / 32, 16] and ``down_proj_scales``. The fused kernels read them packed; the
    reference dequantises each expert it runs.
    """

    #: The stacks held in MXFP4, their (output, input) features by ``(2I, I, hidden)``.
    _MXFP4_STACKS = {"gate_up_proj": lambda i, h: (2 * i, h), "down_proj": lambda i, h: (h, i)}

    activation, output_major, interleaved = "clamped_swiglu", False, True

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        swiglu_limit: float,
        alpha: float = 1.702,
        kernels: LayerKernels = TORCH_KERNELS,
        mxfp4: bool = False,
    ) -> None:
        super().__init__(num_experts, intermediate_size, kernels)
        inter = self.intermediate_size
        self.alpha, self.limit = alpha, swiglu_limit
        self.hidden_size = hidden_size
        self.mxfp4 = False
        # (In this order, which seeded dummy weights follow.) MXFP4 banks never hold the
        # dense stacks: gpt-oss-120b's would not fit beside the packed ones.
        if not mxfp4:
            self.gate_up_proj = _stacked(num_experts, hidden_size, 2 * inter)
        self.gate_up_proj_bias = _stacked(num_experts, 2 * inter)
        if not mxfp4:
            self.down_proj = _stacked(num_experts, inter, hidden_size)
        self.down_proj_bias = _stacked(num_experts, hidden_size)
        if mxfp4:
            self.hold_mxfp4()

    def hold_mxfp4(self) -> None:
        """Empty MXFP4 stacks for an MXFP4 checkpoint to fill, in place of any dense ones. A
        tensor-parallel rank holds down's inputs in whole 32-value blocks (else refused)."""
        if self.mxfp4:
            return
        e, inter = self.num_experts, self.intermediate_size
        if self.tp is not None and (inter % BLOCK or self.inter_start % BLOCK):
            raise ValueError(
                f"down_proj_blocks: tensor parallelism gives each rank {inter} of the experts' "
                f"intermediate features, which splits its {BLOCK}-value MXFP4 blocks"
            )
        for name, features in self._MXFP4_STACKS.items():
            blocks, scales = packed_shapes(*features(inter, self.hidden_size), name)
            dense = getattr(self, name, None)
            device = None if dense is None else dense.device  # None: the default device
            if dense is not None:
                delattr(self, name)
            for suffix, shape in (("_blocks", blocks), ("_scales", scales)):
                empty = torch.empty(e, *shape, dtype=torch.uint8, device=device)
                self.register_parameter(name + suffix, _frozen(empty))
        self.mxfp4 = True

    def randomize_mxfp4(self, std: float, generator: torch.Generator) -> None:
        """Dummy MXFP4 weights: uniformly random values (their RMS about 2.93) under the one
        scale that makes their standard deviation about ``std``."""
        exponent = 127 + round(math.log2(std / 2.93))
        for name in self._MXFP4_STACKS:
            blocks = getattr(self, name + "_blocks")
            blocks.copy_(torch.randint(0, 256, blocks.shape, generator=generator,
                                       device=blocks.device))  # fmt: skip
            getattr(self, name + "_scales").fill_(exponent)

    def checkpoint_part(
        self, name: str, loaded: torch.Tensor, shard: tuple[int, str] | None
    ) -> torch.Tensor:
        """As for dense stacks; MXFP4 down stacks split their inputs in whole 32-value blocks
        (which :meth:`hold_mxfp4` checked)."""
        if self.tp is None or name not in ("down_proj_blocks", "down_proj_scales"):
            return super().checkpoint_part(name, loaded, shard)
        return loaded.narrow(2, self.inter_start // BLOCK, self.intermediate_size // BLOCK)

    def _intermediate_dim(self, name: str, shard: None) -> int | None:
        # Gate and up columns alternate, so a run of features is a run of column pairs (of
        # rows of MXFP4 blocks and scales).
        dims = {"gate_up_proj": 2, "gate_up_proj_bias": 1, "down_proj": 1}
        return (dims | {"gate_up_proj_blocks": 1, "gate_up_proj_scales": 1}).get(name)

    def _intermediate_width(self, name: str) -> int:
        return 2 if name.startswith("gate_up") else 1

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: None) -> None:
        if self.tp is not None and param is self.down_proj_bias and self.tp.rank:
            loaded = torch.zeros_like(loaded)  # the block's all-reduce adds rank 0's once
        super().weight_loader(param, loaded, shard)

    def weights_of(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ``e``'s input-major ``gate_up`` and ``down`` in ``dtype`` (dequantised if
        MXFP4)."""
        if not self.mxfp4:
            return self.gate_up_proj[e].to(dtype), self.down_proj[e].to(dtype)
        return tuple(
            dequantize_mxfp4(getattr(self, f"{n}_blocks")[e], getattr(self, f"{n}_scales")[e])
            .t()
            .to(dtype)
            for n in self._MXFP4_STACKS
        )

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate_up_w, down_w = self.weights_of(e, x.dtype)
        gate_up = x @ gate_up_w + self.gate_up_proj_bias[e]
        glu = clamped_swiglu(gate_up, self.alpha, self.limit)
        return glu @ down_w + self.down_proj_bias[e]

    def fused_layout(self) -> dict:
        extra = dict(
            gate_up_bias=self.gate_up_proj_bias,
            down_bias=self.down_proj_bias,
            alpha=self.alpha,
            limit=self.limit,
        )
        if not self.mxfp4:
            return super().fused_layout() | extra
        packed = {arg: getattr(self, name) for arg, name in _MXFP4_ARGS.items()}
        layout = dict(activation=self.activation, output_major=True, interleaved=True)
        return packed | layout | extra


class SparseMoE(nn.Module):
    """``experts(x)`` over the router's choice, plus ``shared_expert(x)`` (a dense gated MLP
    every token passes through) scaled by ``sigmoid(shared_expert_gate(x))`` where there is a
    gate. Build it from explicit pieces, or from a config with a family helper (``qwen``)."""

    def __init__(
        self,
        gate: TopKRouter,
        experts: ExpertBank,
        shared_expert: GatedMLP | None = None,
        shared_expert_gate: Linear | None = None,
    ) -> None:
        super().__init__()
        if shared_expert_gate is not None and shared_expert is None:
            raise ValueError("SparseMoE: a shared_expert_gate needs a shared_expert")
        down = shared_expert.down_proj if shared_expert is not None else None
        if down is not None and down.parallel and down.reduce_output:
            raise ValueError(
                "SparseMoE: the block sums its shared expert over the ranks with the routed "
                "experts; build the shared expert with reduce_output=False"
            )
        self.gate = gate
        self.experts = experts
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate

    @classmethod
    def swiglu(
        cls,
        hidden_size: int,
        num_experts: int,
        intermediate_size: int,
        routing: Routing,
        *,
        shared_intermediate_size: int = 0,
        gated_shared_expert: bool = False,
        kernels: LayerKernels = TORCH_KERNELS,
    ) -> SparseMoE:
        """Plain SwiGLU experts with a bias-free router, and a shared SwiGLU expert of width
        ``shared_intermediate_size`` (none if 0), sigmoid-gated if ``gated_shared_expert``."""
        shared = gate = None
        if shared_intermediate_size:
            shared = GatedMLP(
                hidden_size,
                shared_intermediate_size,
                SiluAndMul,
                False,
                kernels,
                reduce_output=False,  # the block's one all-reduce sums it with the experts
            )
            if gated_shared_expert:
                gate = Linear(hidden_size, 1, False, kernels)
        return cls(
            TopKRouter(hidden_size, num_experts, routing, kernels=kernels),
            SwiGLUExperts(num_experts, hidden_size, intermediate_size, kernels),
            shared,
            gate,
        )

    @classmethod
    def qwen(cls, config: PretrainedConfig, kernels: LayerKernels = TORCH_KERNELS) -> SparseMoE:
        """Qwen2-MoE, Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE: softmax top-k routing and, where the
        config has ``shared_expert_intermediate_size``, a sigmoid-gated shared expert."""
        return cls.swiglu(
            config.hidden_size,
            config.num_experts,
            config.moe_intermediate_size,
            Routing.qwen(config),
            shared_intermediate_size=getattr(config, "shared_expert_intermediate_size", 0) or 0,
            gated_shared_expert=True,
            kernels=kernels,
        )

    @classmethod
    def deepseek(cls, config: PretrainedConfig, kernels: LayerKernels = TORCH_KERNELS) -> SparseMoE:
        """DeepSeek-V2 (softmax routing) and V3 (sigmoid with correction bias): routed experts
        and ``n_shared_experts`` ungated shared experts, one MLP of their summed width.
        Checkpoints call them ``shared_experts``: rename that to ``shared_expert``."""
        v3 = config.model_type != "deepseek_v2"
        routing = Routing.deepseek_v3(config) if v3 else Routing.deepseek_v2(config)
        return cls.swiglu(
            config.hidden_size,
            config.n_routed_experts,
            config.moe_intermediate_size,
            routing,
            shared_intermediate_size=config.moe_intermediate_size * (config.n_shared_experts or 0),
            kernels=kernels,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [tokens, hidden] -> [tokens, hidden]."""
        shared = gate = None
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                gate = self.shared_expert_gate(x)
        out = self.experts(x, *self.gate(x), shared, gate)
        # Tensor-parallel, each rank's experts (and shared expert) hold part of the features:
        # one all-reduce sums both (the replicated gate scales each rank's part alike).
        return out if self.experts.tp is None else self.experts.tp.all_reduce(out)
