"""Causal conv1d over a packed variable-length batch (prefill and extend of the gated-delta-rule
layer), each request continuing from the conv state in its slot, updated in place.

Two launches: :func:`causal_conv1d_varlen` first computes every token's SiLU(conv) from the
slots' old states, then rewrites each slot with the request's last ``W - 1`` inputs; one launch
could not do both, because a sequence's later tiles would overwrite the state its first tile
still reads. Tiles are the chunked rule's ones (``chunk_indices``: request, tile within it), so
one piece of step metadata serves the conv and the rule. A row without a saved state starts
from zeros whatever its slot holds. Numerics follow
``heron.ops.linear_attention.reference.causal_conv1d`` (fp32 accumulation).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_varlen_kernel(
    x_ptr,  # [T, C]
    state_ptr,  # [slots, C, W - 1]
    weight_ptr,  # [C, W] (any strides)
    out_ptr,  # [T, C]
    cu_seqlens_ptr,  # [N + 1]
    chunk_indices_ptr,  # [tiles, 2]: request, tile within it
    slots_ptr,
    has_state_ptr,
    channels,
    stride_slots,
    stride_x,
    stride_state_slot,
    stride_state_c,
    stride_weight_c,
    stride_weight_w,
    stride_out,
    WIDTH: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    tile = tl.program_id(1)
    seq = tl.load(chunk_indices_ptr + tile * 2)
    first = tl.load(chunk_indices_ptr + tile * 2 + 1) * BLOCK_T
    bos = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
    length = tl.load(cu_seqlens_ptr + seq + 1).to(tl.int64) - bos
    slot = tl.load(slots_ptr + seq * stride_slots).to(tl.int64)
    keep = tl.load(has_state_ptr + seq) != 0
    c_mask = cols < channels
    pos = first + tl.arange(0, BLOCK_T).to(tl.int64)  # within the request
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for i in tl.static_range(WIDTH):
        src = pos + (i - WIDTH + 1)  # the input tap i reads; < 0: from the saved state
        from_x = (src >= 0) & (src < length)
        xs = tl.load(
            x_ptr + (bos + src)[:, None] * stride_x + cols[None, :],
            mask=from_x[:, None] & c_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        from_state = (src < 0) & keep
        ss = tl.load(
            state_ptr
            + slot * stride_state_slot
            + cols[None, :] * stride_state_c
            + (src + WIDTH - 1)[:, None],
            mask=from_state[:, None] & c_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        w = tl.load(weight_ptr + cols * stride_weight_c + i * stride_weight_w, mask=c_mask)
        acc += (xs + ss) * w.to(tl.float32)[None, :]
    out = acc / (1.0 + tl.exp(-acc))
    tl.store(
        out_ptr + (bos + pos)[:, None] * stride_out + cols[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=(pos < length)[:, None] & c_mask[None, :],
    )


@triton.jit
def _conv_state_kernel(
    x_ptr,
    state_ptr,
    cu_seqlens_ptr,
    slots_ptr,
    has_state_ptr,
    channels,
    stride_slots,
    stride_x,
    stride_state_slot,
    stride_state_c,
    WIDTH: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    seq = tl.program_id(1)
    bos = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
    length = tl.load(cu_seqlens_ptr + seq + 1).to(tl.int64) - bos
    slot = tl.load(slots_ptr + seq * stride_slots).to(tl.int64)
    keep = tl.load(has_state_ptr + seq) != 0
    c_mask = cols < channels
    state = state_ptr + slot * stride_state_slot + cols * stride_state_c
    # Entry j becomes input length - (W - 1) + j. Ascending j reads an old entry (j + length)
    # before any store reaches it, and each channel stays with one thread throughout.
    for j in tl.static_range(WIDTH - 1):
        src = length - (WIDTH - 1) + j
        xs = tl.load(x_ptr + (bos + src) * stride_x + cols, mask=c_mask & (src >= 0), other=0.0)
        old = tl.load(state + src + WIDTH - 1, mask=c_mask & (src < 0) & keep, other=0.0)
        value = tl.where(src >= 0, xs.to(state_ptr.dtype.element_ty), old)
        tl.store(state + j, value, mask=c_mask)


def causal_conv1d_varlen(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    chunk_indices: torch.Tensor,
    chunk_size: int,
    slots: torch.Tensor,
    has_state: torch.Tensor,
) -> torch.Tensor:
    """x [T, C] packed by ``cu_seqlens`` [N + 1] -> SiLU(conv) [T, C]. Request ``n`` continues
    from ``conv_state[slots[n]]`` [C, W - 1] (zeros where not ``has_state[n]``), which then
    holds its last ``W - 1`` inputs. ``chunk_indices`` [tiles, 2] cover each request in tiles
    of ``chunk_size`` tokens; ``slots`` may be strided, ``has_state`` is contiguous."""
    channels = x.shape[1]
    width = weight.shape[1]
    if conv_state.shape[1:] != (channels, width - 1) or conv_state.stride(2) != 1:
        raise ValueError(f"conv_state {tuple(conv_state.shape)} does not fit x and weight")
    if x.stride(1) != 1:
        raise ValueError("x's rows must be contiguous")
    out = torch.empty_like(x)
    num_seqs, num_tiles = cu_seqlens.shape[0] - 1, chunk_indices.shape[0]
    if not num_tiles:
        return out
    block_c = min(64, triton.next_power_of_2(channels))
    common = (channels, slots.stride(0), x.stride(0), conv_state.stride(0), conv_state.stride(1))
    _conv_varlen_kernel[(triton.cdiv(channels, block_c), num_tiles)](
        x,
        conv_state,
        weight,
        out,
        cu_seqlens,
        chunk_indices,
        slots,
        has_state,
        *common,
        weight.stride(0),
        weight.stride(1),
        out.stride(0),
        WIDTH=width,
        BLOCK_T=chunk_size,
        BLOCK_C=block_c,
    )
    block_s = min(256, triton.next_power_of_2(channels))
    _conv_state_kernel[(triton.cdiv(channels, block_s), num_seqs)](
        x,
        conv_state,
        cu_seqlens,
        slots,
        has_state,
        *common,
        WIDTH=width,
        BLOCK_C=block_s,
    )
    return out
