"""Gated activations in Triton: ``act(gate) * up`` (SiLU, GELU-tanh or a sigmoid gate) over
``[gate | up]``.

Numerics follow ``heron.layers.activation``: the activation is rounded to the input dtype before
its product with ``up``, as PyTorch's ``act(gate) * up`` in that dtype rounds it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from heron.kernels.pdl import pdl_launch, wait_for_previous_kernel
from heron.kernels.rmsnorm import check_rows

#: Gated activations the kernels apply to ``[gate | up]``: ``act(gate) * up``.
ACTIVATIONS = {"silu": 1, "gelu_tanh": 2, "sigmoid": 3}


@triton.jit
def gated(gate, up, ACT: tl.constexpr, dtype: tl.constexpr):
    """``act(gate) * up`` in fp32 (SiLU, GELU's tanh approximation, or the sigmoid), with the
    activation rounded to ``dtype`` first, as PyTorch's ``act(gate) * up`` in ``dtype`` rounds
    it."""
    g = gate.to(tl.float32)
    if ACT == 1:
        a = g / (1.0 + tl.exp(-g))
    elif ACT == 3:
        a = tl.sigmoid(g)
    else:
        # 0.5 * g * (1 + tanh(z)) with tanh(z) = 2 * sigmoid(2z) - 1
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = g * tl.sigmoid(2.0 * z)
    return a.to(dtype).to(tl.float32) * up.to(tl.float32)


@triton.jit
def _gated_activation_kernel(
    x_ptr,
    out_ptr,
    n_inter,
    stride_x,
    stride_out,
    ACT: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    row = tl.cast(tl.program_id(0), tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_inter + cols, mask=mask, other=0.0)
    out = gated(gate, up, ACT, x_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def gated_activation(x: torch.Tensor, act: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """``act(gate) * up`` for ``x`` [T, 2I] laid out as ``[gate | up]``; returns [T, I].

    ``act`` is a key of ``ACTIVATIONS``; ``out`` (optional, [T, I], contiguous rows) receives
    the result.
    """
    check_rows("x", x)
    n_rows, width = x.shape
    if width % 2:
        raise ValueError(f"x's last dimension must be even, got {width}")
    n_inter = width // 2
    if out is None:
        out = torch.empty((n_rows, n_inter), dtype=x.dtype, device=x.device)
    else:
        check_rows("out", out)
        if out.shape != (n_rows, n_inter):
            raise ValueError(f"out {tuple(out.shape)} != {(n_rows, n_inter)}")
    if n_rows > 0:
        block = min(1024, triton.next_power_of_2(n_inter))
        _gated_activation_kernel[(n_rows, triton.cdiv(n_inter, block))](
            x,
            out,
            n_inter,
            x.stride(0),
            out.stride(0),
            ACT=ACTIVATIONS[act],
            BLOCK=block,
            num_warps=4 if block >= 512 else 1,
            **pdl_launch(x.device),
        )
    return out
