"""Mixture-of-experts MLP (gpt-oss): a top-k router over experts with clamped SwiGLU.

With the Triton kernel set the experts run as two fused grouped GEMMs (``heron.kernels.moe``),
with no host sync, in eager steps and CUDA graphs alike. Otherwise they run the reference in
plain PyTorch, which loops over the experts: correct and readable but not fast.
"""

from __future__ import annotations

import torch
from torch import nn

from heron.kernels import TORCH_KERNELS, LayerKernels
from heron.layers.linear import Linear


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's SwiGLU over ``gate_up`` [..., 2I] whose gate and up columns alternate.

    The gate is clamped from above and the up projection on both sides, so that outliers
    cannot blow up the product; ``up + 1`` keeps a path through the unit when ``up`` is zero.
    """
    gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(alpha * gate))


class ClampedSwiGLUExperts(nn.Module):
    """``num_experts`` two-layer MLPs with biases, stored as checkpoints store them.

    The weights are input-major (``y = x @ W + b``): ``gate_up_proj`` [E, hidden, 2I] with gate
    and up columns interleaved, ``down_proj`` [E, I, hidden]. Parameter names equal the
    checkpoint's, so the generic loader fills them.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        swiglu_limit: float,
        alpha: float = 1.702,
        kernels: LayerKernels = TORCH_KERNELS,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.fused = kernels.fused_experts
        self.alpha, self.limit = alpha, swiglu_limit

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape), requires_grad=False)

        self.gate_up_proj = param(num_experts, hidden_size, 2 * intermediate_size)
        self.gate_up_proj_bias = param(num_experts, 2 * intermediate_size)
        self.down_proj = param(num_experts, intermediate_size, hidden_size)
        self.down_proj_bias = param(num_experts, hidden_size)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` applied to the rows of ``x`` [n, hidden]."""
        gate_up = x @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
        glu = clamped_swiglu(gate_up, self.alpha, self.limit)
        return glu @ self.down_proj[e] + self.down_proj_bias[e]

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor
    ) -> torch.Tensor:
        """Sum over each token's experts ``indices`` [T, k], weighted by ``weights`` [T, k]."""
        if self.fused is not None:
            return self.fused(
                x,
                weights,
                indices,
                self.gate_up_proj,
                self.gate_up_proj_bias,
                self.down_proj,
                self.down_proj_bias,
                self.alpha,
                self.limit,
            )
        return self.forward_sparse(x, weights, indices)

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


class MoEMLP(nn.Module):
    """Router (a linear layer with bias) then each token's top-k experts.

    A token's expert weights are the softmax over its selected router logits only.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        swiglu_limit: float,
        kernels: LayerKernels = TORCH_KERNELS,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
        self.top_k = top_k
        self.router = Linear(hidden_size, num_experts, bias=True, kernels=kernels)
        self.experts = ClampedSwiGLUExperts(
            num_experts, hidden_size, intermediate_size, swiglu_limit, kernels=kernels
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [tokens, hidden] -> [tokens, hidden]."""
        top_logits, indices = self.router(x).topk(self.top_k, dim=-1)
        return self.experts(x, torch.softmax(top_logits, dim=-1), indices)
