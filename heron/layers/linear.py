"""Linear layers whose checkpoint shards are packed into one matrix at load time."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from heron.kernels import TORCH_KERNELS, LayerKernels


class Linear(nn.Module):
    """``y = x W^T (+ b)``; weights load through :meth:`weight_loader`. Decode-sized products
    take the kernel set's GEMV where it serves them (:func:`linear`)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        kernels: LayerKernels = TORCH_KERNELS,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.kernels)

    def takes_gemv(self, x: torch.Tensor) -> bool:
        """Whether this layer's product with ``x``'s rows runs as the GEMV."""
        return takes_gemv(self.kernels, x, self.weight)

    def forward_gated(self, gate_up: torch.Tensor, act: nn.Module) -> torch.Tensor:
        """``self(act(gate_up))`` for a gated activation over ``[gate | up]``; where the product
        runs as the GEMV, it applies the activation as it loads its input (one kernel, no
        intermediate)."""
        fused = getattr(act, "fused_name", None)
        if fused is not None and self.takes_gemv(gate_up):
            return self.kernels.gemv(gate_up, self.weight, self.bias, act=fused)
        return self(act(gate_up))

    def forward_activated(self, x: torch.Tensor, act: nn.Module) -> torch.Tensor:
        """``act(self(x))`` for a gated activation over this layer's ``[gate | up]`` output;
        where the product runs as the GEMV, the activation is its epilogue (one kernel, no
        intermediate)."""
        fused = getattr(act, "fused_name", None)
        if fused is not None and self.takes_gemv(x):
            return self.kernels.gemv(x, self.weight, self.bias, gated_out=fused)
        return act(self(x))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None) -> None:
        _copy_checked(param.data, loaded, param)


class PackedLinear(Linear):
    """Several checkpoint matrices stacked along the output dimension (fused qkv, gate_up).

    ``shards`` maps each checkpoint shard name to its number of output rows, in order.
    """

    def __init__(
        self,
        in_features: int,
        shards: dict[str, int],
        bias: bool = False,
        kernels: LayerKernels = TORCH_KERNELS,
    ) -> None:
        super().__init__(in_features, sum(shards.values()), bias, kernels)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in shards.items():
            self.shard_offsets[name] = (start, size)
            start += size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None) -> None:
        if shard not in self.shard_offsets:
            raise ValueError(f"unknown shard {shard!r}; expected one of {list(self.shard_offsets)}")
        start, size = self.shard_offsets[shard]
        _copy_checked(param.data.narrow(0, start, size), loaded, param)


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


_GEMV_DTYPES = (torch.bfloat16, torch.float16)


def takes_gemv(kernels: LayerKernels, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x`` times ``weight`` goes to the kernel set's GEMV: few rows (its ``serves``
    says how few), in half precision, where the kernel is faster than the vendor GEMM."""
    return (
        kernels.gemv is not None
        and x.dim() == 2
        and x.dtype in _GEMV_DTYPES
        and kernels.gemv_serves(x.shape[0], *weight.shape, x.device)
    )


def _copy_checked(target: torch.Tensor, loaded: torch.Tensor, param: nn.Parameter) -> None:
    if target.shape != loaded.shape:
        raise ValueError(
            f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit a parameter slice of "
            f"shape {tuple(target.shape)} (parameter {tuple(param.shape)})"
        )
    target.copy_(loaded)
