"""Gated activations: ``act(gate) * up`` over an input laid out as ``[gate | up]``."""

import torch
import torch.nn.functional as F
from torch import nn

from heron.kernels import TORCH_KERNELS, LayerKernels


class GatedActivation(nn.Module):
    """``act(gate) * up``: the kernel set's gated activation where it has one, else PyTorch
    (:meth:`reference`).

    ``fused_name`` names the activation for the Triton kernels
    (``heron.kernels.activation.ACTIVATIONS``), which the decode GEMV also applies inside the
    down projection.
    """

    fused_name: str

    def __init__(self, kernels: LayerKernels = TORCH_KERNELS) -> None:
        super().__init__()
        self.kernel = kernels.gated_activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and x.dim() == 2:
            return self.kernel(x, self.fused_name)
        gate, up = x.chunk(2, dim=-1)
        return self.reference(gate) * up

    @staticmethod
    def reference(gate: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class SiluAndMul(GatedActivation):
    """``silu(gate) * up`` (Llama's MLP)."""

    fused_name = "silu"

    @staticmethod
    def reference(gate: torch.Tensor) -> torch.Tensor:
        return F.silu(gate)


class GeluTanhAndMul(GatedActivation):
    """``gelu_tanh(gate) * up`` (Gemma's MLP)."""

    fused_name = "gelu_tanh"

    @staticmethod
    def reference(gate: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate, approximate="tanh")


class SigmoidAndMul(GatedActivation):
    """``sigmoid(gate) * up`` (the output gate of Qwen3.5's attention)."""

    fused_name = "sigmoid"

    @staticmethod
    def reference(gate: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(gate)
