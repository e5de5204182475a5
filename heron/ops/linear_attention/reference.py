"""Gated delta rule and causal conv1d in plain PyTorch, for one sequence: the CPU path and the
reference the kernels are tested against.

The recurrence, per head, for tokens ``t`` with ``q, k`` L2-normalised and ``q`` scaled by
``key_dim ** -0.5``::

    S = exp(g_t) * S
    S = S + beta_t * k_t (v_t - k_t^T S)^T      (S: [key_dim, value_dim])
    o_t = S^T q_t

:func:`recurrent_gated_delta_rule` runs it token by token; :func:`chunked_gated_delta_rule`
computes the same with matrix products over chunks (the WY/UT form), which is what a prefill
kernel does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension (fla's and HF's form)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def prepare_qk(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k as the recurrence reads them: fp32, L2-normalised, q scaled by ``key_dim ** -0.5``."""
    q, k = l2_normalize(q.float()), l2_normalize(k.float())
    return q * q.shape[-1] ** -0.5, k


def _prepare(q: torch.Tensor, k: torch.Tensor, *rest: torch.Tensor) -> list[torch.Tensor]:
    """:func:`prepare_qk`, everything fp32 and heads first ([T, H, ...] -> [H, T, ...])."""
    q, k = prepare_qk(q, k)
    return [x.float().transpose(0, 1) for x in (q, k, *rest)]


def _initial_state(state: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """An fp32 copy of ``state``, or zeros [H, Dk, Dv] for heads-first ``k`` and ``v``."""
    if state is None:
        return torch.zeros(k.shape[0], k.shape[-1], v.shape[-1], device=v.device)
    return state.float().clone()


def gated_delta_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the recurrence for any leading dimensions (heads, or rows and heads).

    q, k: [..., Dk] (from :func:`prepare_qk`); v: [..., Dv]; g, beta: [...]; state:
    [..., Dk, Dv] fp32. Returns the output [..., Dv] and the new state.
    """
    state = state * g.exp()[..., None, None]
    delta = (v - (k[..., None] * state).sum(-2)) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (q[..., None] * state).sum(-2), state


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k: [T, H, Dk]; v: [T, H, Dv]; g, beta: [T, H]; state: [H, Dk, Dv] (zeros if None).

    Returns the output [T, H, Dv] (fp32) and the final state [H, Dk, Dv] (fp32).
    """
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    state = _initial_state(state, k, v)
    out = torch.empty_like(v)
    for t in range(k.shape[1]):
        out[:, t], state = gated_delta_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
    return out.transpose(0, 1), state


def chunked_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as :func:`recurrent_gated_delta_rule`, chunk by chunk.

    Within a chunk the delta-rule updates form a unit lower-triangular system ``(I + A) U =
    beta * V`` (``A`` the decayed ``beta k_i . k_j`` for ``j < i``); solving it gives the
    values each token actually writes, so a chunk costs a few matrix products and one state
    update instead of a step per token.
    """
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    num_heads, length, _ = k.shape
    pad = -length % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    chunks = lambda x: x.reshape(num_heads, -1, chunk_size, *x.shape[2:])
    q, k, v, g, beta = map(chunks, (q, k, v, g, beta))
    decay = g.cumsum(-1)  # [H, chunks, C]: log decay from the chunk's start
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # exp(decay_i - decay_j) for j <= i, 0 above the diagonal.
    pairwise = (decay[..., :, None] - decay[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * pairwise
    solve = lambda rhs: torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    values = solve(v * beta[..., None])
    state_keys = solve(k_beta * decay.exp()[..., None])  # what each token reads of the old state
    intra = (q @ k.transpose(-1, -2)) * pairwise
    q_decayed = q * decay.exp()[..., None]
    k_to_end = k * (decay[..., -1:] - decay).exp()[..., None]
    state = _initial_state(state, k, v)
    out = torch.empty_like(v)
    for c in range(q.shape[1]):
        written = values[:, c] - state_keys[:, c] @ state
        out[:, c] = q_decayed[:, c] @ state + intra[:, c] @ written
        state = (
            state * decay[:, c, -1].exp()[:, None, None]
            + k_to_end[:, c].transpose(-1, -2) @ written
        )
    out = out.reshape(num_heads, -1, v.shape[-1])[:, :length]
    return out.transpose(0, 1), state


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution then SiLU, continuing from ``state``.

    x: [T, C]; weight: [C, K]; state: [C, K - 1], the inputs before ``x`` (zeros if None).
    Returns the output [T, C] in ``x``'s dtype and the new state (the last K - 1 inputs).
    """
    channels, width = weight.shape
    if state is None:
        state = x.new_zeros(channels, width - 1)
    inputs = torch.cat([state.to(x.dtype), x.transpose(0, 1)], dim=1)  # [C, K - 1 + T]
    out = F.conv1d(inputs[None].to(weight.dtype), weight[:, None], groups=channels)[0]
    return F.silu(out).transpose(0, 1).to(x.dtype), inputs[:, inputs.shape[1] - width + 1 :]


def causal_conv1d_step(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of :func:`causal_conv1d` per row: x [N, C], state [N, C, K - 1]."""
    inputs = torch.cat([state.to(weight.dtype), x[..., None].to(weight.dtype)], dim=-1)
    out = F.silu((inputs * weight).sum(-1))
    return out.to(x.dtype), inputs[..., 1:]
