"""RMS norms (Llama-style and Gemma-style), optionally fused with the residual add."""

from __future__ import annotations

import torch
from torch import nn

from heron.kernels import TORCH_KERNELS, LayerKernels


class RMSNorm(nn.Module):
    """HF Llama's RMSNorm: ``weight * norm(x)``, with ``norm(x)`` cast to ``x``'s dtype first."""

    # The form the Triton kernels (the norm itself, the fused qk-norm) compute: the output is
    # (weight + weight_offset) * x / rms(x), scaled in fp32 and cast once if scale_in_fp32, else
    # with x / rms(x) cast to x's dtype before the scaling. A subclass that changes ``_scale``
    # must set them to match.
    weight_offset = 0.0
    scale_in_fp32 = False

    def __init__(
        self, hidden_size: int, eps: float = 1e-6, kernels: LayerKernels = TORCH_KERNELS
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.kernel = kernels.rms_norm

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        prenorm: RMSNorm | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual``: norm(x). With it: (norm(x + residual), x + residual).
        With ``prenorm``, ``prenorm(x)`` takes the place of ``x`` (a post-norm before the
        residual add, as Gemma's layers have).

        The kernel set's fused norm does it all in one launch (it updates ``residual`` in
        place); the prenorm joins it when it has this norm's form and eps.
        """
        if prenorm is not None and not self._same_form(prenorm):
            x, prenorm = prenorm(x), None
        if self.kernel is not None and x.dim() == 2:
            return self.kernel(
                x,
                self.weight,
                self.eps,
                residual,
                self.weight_offset,
                self.scale_in_fp32,
                prenorm.weight if prenorm is not None else None,
            )
        if prenorm is not None:
            x = prenorm(x)
        if residual is not None:
            x = x + residual
            residual = x
        # Statistics in fp32, like HF's norms.
        out = self._scale(_normalize(x, self.eps), x.dtype)
        return out if residual is None else (out, residual)

    def _same_form(self, other: RMSNorm) -> bool:
        return (other.weight_offset, other.scale_in_fp32, other.eps, other.weight.dtype) == (
            self.weight_offset,
            self.scale_in_fp32,
            self.eps,
            self.weight.dtype,
        )

    def _scale(self, normed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The weight applied to the fp32 ``x / rms(x)``: cast first, then scaled (Llama)."""
        return self.weight * normed.to(dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: ``norm(x) * (1 + weight)``, all in fp32, then cast to ``x``'s dtype.

    Checkpoints store the weight centred on zero. Unlike :class:`RMSNorm` (which casts before
    scaling), HF's Gemma norms scale in fp32 and cast last; in bf16 the two round differently.
    """

    weight_offset = 1.0  # see RMSNorm
    scale_in_fp32 = True

    def __init__(
        self, hidden_size: int, eps: float = 1e-6, kernels: LayerKernels = TORCH_KERNELS
    ) -> None:
        super().__init__(hidden_size, eps, kernels)
        nn.init.zeros_(self.weight)

    def _scale(self, normed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (normed * (1.0 + self.weight.float())).to(dtype)


class GatedRMSNorm(nn.Module):
    """HF's ``RMSNormGated`` (Qwen3.5 / Qwen3-Next linear attention): ``weight * norm(x)``
    (cast to ``x``'s dtype before scaling) times ``silu(gate)`` in fp32, cast last."""

    def __init__(
        self, hidden_size: int, eps: float = 1e-6, kernels: LayerKernels = TORCH_KERNELS
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.kernel = kernels.gated_rms_norm

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``x``, ``gate``: [tokens, heads, head_dim] (the norm is over each head)."""
        if self.kernel is not None:
            return self.kernel(x, gate, self.weight, self.eps)
        out = self.weight * _normalize(x, self.eps).to(x.dtype)
        return (out * torch.nn.functional.silu(gate.float())).to(x.dtype)


def _normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x)`` over the last dimension, in fp32."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
