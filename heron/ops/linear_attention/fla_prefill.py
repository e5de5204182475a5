"""Prefill and extend of the gated delta rule on the GPU over the whole packed batch: Heron's
varlen conv kernel, then fla-core's chunked rule with each request's recurrent state gathered
from its slot and the final states scattered back.

fla-core is an optional CUDA dependency; it is imported only when a GPU operator is built
(:func:`load_chunk_rule`), never on the CPU path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from heron.kernels.causal_conv1d import causal_conv1d_varlen
from heron.ops.linear_attention.builder import GatedDeltaNetView

logger = logging.getLogger(__name__)

#: fla's chunk length; the builder tiles extend steps by it for the conv and the rule alike.
FLA_CHUNK_SIZE = 64

_warned: list[ImportError] = []


def load_chunk_rule() -> Callable | None:
    """fla-core's ``chunk_gated_delta_rule``, or None (logged) where it cannot be imported."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as exc:
        if not _warned:
            _warned.append(exc)  # once per process, not once per layer
            logger.warning(
                "fla-core is not importable (%s): gated-delta-rule prefill runs the PyTorch "
                "chunked rule one request at a time",
                exc,
            )
        return None
    return chunk_gated_delta_rule


def chunked_prefill(
    chunk_rule: Callable,
    x: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_state: torch.Tensor,
    recurrent_state: torch.Tensor,
    num_key_heads: int,
    view: GatedDeltaNetView,
) -> torch.Tensor:
    """x: the projected ``[q|k|v]`` [T, conv_dim]; g (log decay), beta: [T, Hv] fp32. Updates
    both states of every row's slot; returns [T, Hv, V] in ``x``'s dtype."""
    if view.chunk_indices is None:
        raise ValueError("the view has no chunk tiling: its builder was made without chunk_size")
    n = view.num_reqs
    slots, keep = view.state_slots[:n], view.has_initial_state[:n]
    conv_out = causal_conv1d_varlen(
        x,
        conv_state,
        conv_weight,
        view.cu_seqlens,
        view.chunk_indices,
        FLA_CHUNK_SIZE,
        slots,
        keep,
    )
    _, num_value_heads, key_dim, value_dim = recurrent_state.shape
    key_size = num_key_heads * key_dim
    q, k, v = conv_out.split([key_size, key_size, num_value_heads * value_dim], dim=-1)
    tokens = x.shape[0]
    index = slots.long()
    # A row without a saved state starts from zeros whatever (even NaN) its slot holds.
    initial = recurrent_state[index].float().masked_fill_(~keep[:, None, None, None], 0.0)
    out, final = chunk_rule(
        q.reshape(1, tokens, num_key_heads, key_dim),
        k.reshape(1, tokens, num_key_heads, key_dim),
        v.reshape(1, tokens, num_value_heads, value_dim),
        g=g[None],
        beta=beta[None],
        initial_state=initial,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=view.cu_seqlens,
        chunk_indices=view.chunk_indices,
    )
    recurrent_state.index_copy_(0, index, final.to(recurrent_state.dtype))
    return out[0]
