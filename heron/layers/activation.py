"""Activation functions."""

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` for an input laid out as ``[gate | up]``."""

    fused_name = "silu"  # the GEMV's fused activation (heron.layers.triton_gemv.ACTIVATIONS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from heron.layers.triton_kernels import silu_and_mul

            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """``gelu_tanh(gate) * up`` for an input laid out as ``[gate | up]`` (Gemma's MLP)."""

    fused_name = "gelu_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
