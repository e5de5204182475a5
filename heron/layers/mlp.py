"""The gated MLP: ``down(act(gate(x)) * up(x))``, gate and up packed into one projection."""

from __future__ import annotations

import torch
from torch import nn

from heron.kernels import TORCH_KERNELS, LayerKernels
from heron.layers.activation import GatedActivation
from heron.layers.linear import Linear, PackedLinear


class GatedMLP(nn.Module):
    """Gate and up packed into one projection, then the gated activation and the down
    projection; the activation is fused into whichever projection runs as the GEMV.
    Tensor-parallel, each rank holds a slice of the intermediate features (gate_up column-,
    down row-parallel: one all-reduce, or none with ``reduce_output=False``, where the caller
    sums this partial output over the ranks with its own)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        act: type[GatedActivation],
        bias: bool = False,
        kernels: LayerKernels = TORCH_KERNELS,
        reduce_output: bool = True,
    ) -> None:
        super().__init__()
        self.gate_up_proj = PackedLinear(
            hidden_size,
            {"gate": intermediate_size, "up": intermediate_size},
            bias,
            kernels,
            parallel="column",
        )
        self.down_proj = Linear(
            intermediate_size, hidden_size, bias, kernels, "row", reduce_output=reduce_output
        )
        self.act = act(kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.down_proj.takes_gemv(x):  # it applies the activation as it loads its input
            return self.down_proj.forward_gated(self.gate_up_proj(x), self.act)
        # Else the gate_up projection applies it, in its epilogue where it can.
        return self.down_proj(self.gate_up_proj.forward_activated(x, self.act))
