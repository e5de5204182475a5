"""Fused mixture-of-experts: two grouped GEMMs in Triton over one bank of SwiGLU experts.

One pair of kernels serves every expert bank Heron loads (``heron.layers.moe``); constexprs
choose what differs between them:

- ``ACTIVATION``: ``"swiglu"`` (``silu(gate) * up``; Qwen-MoE, DeepSeek) or ``"clamped_swiglu"``
  (gpt-oss: clamped gate and up, ``(up + 1) * gate * sigmoid(alpha * gate)``);
- ``OUTPUT_MAJOR``: weights stored as ``nn.Linear`` stores them (``[E, out, in]``, HF's stacked
  experts) or input-major (``[E, in, out]``, gpt-oss);
- ``INTERLEAVED``: gate and up outputs alternate (gpt-oss) or form two halves ``[gate | up]``;
- ``HAS_BIAS``: per-expert biases (gpt-oss) or none;
- ``SCALE``: weights in ``x``'s dtype (0), or FP8 E4M3 standing for ``q * scale`` with fp32
  scales per output channel (1, applied in the epilogue) or per ``SCALE_BN x SCALE_BK`` tile
  of an output-major weight (2, applied per K step inside the loop; ``BLOCK_K`` divides
  ``SCALE_BK``). FP8 tiles are converted to ``x``'s dtype as they load (weight-only FP8: the
  bytes that bound decode halve, the products stay in half precision). ``SCALE`` 3 is MXFP4
  (gpt-oss): output-major FP4 E2M1 values two a byte with a uint8 E8M0 scale per output channel
  and 32 inputs (``heron.layers.mxfp4``), decoded in registers and scaled per K step of 32.
  ``SCALE`` 4 is packed integers (W4A16, W8A16: GPTQ, AWQ, compressed-tensors), each expert's
  matrices in ``heron.layers.wna16``'s layout (``BITS``-bit values in int32 words along the
  input, scales and optional uint8 zero points per group of ``SCALE_BK`` inputs), a tile
  dequantised in fp32 registers as the dense packed kernels do (``heron.kernels.wna16``), then
  rounded to ``x``'s dtype for the dot; with ``HAS_PERM`` (act-order) the first kernel gathers
  ``x``'s columns in each expert's order.

Every step runs on the GPU with shapes that depend only on the token count, never on the
routing, so there is no host sync and the whole call can be captured in a CUDA graph.

1. ``align_by_expert`` (``heron.kernels.moe_align``) sorts the ``T * k`` (token, slot) pairs
   by expert and lays them out in row blocks of ``BLOCK_M``, each expert's rows padded to a
   whole number of blocks, so that every block belongs to one expert. Padding rows hold the
   sentinel ``T * k``. The buffers are sized for the worst case, ``T * k + min(E, T * k) *
   (BLOCK_M - 1)`` rows; the number of blocks actually used stays on the device.
2. ``_gate_up_kernel``: one program per (row block, column tile). It gathers the block's token
   rows of ``x``, multiplies them by its expert's gate/up weights and applies the activation in
   the epilogue: a tile of ``BLOCK_N`` accumulator columns holds ``BLOCK_N / 2`` (gate, up)
   pairs side by side, read from wherever the layout keeps them. The result ``h`` [rows, I]
   stays in the sorted row order.
3. ``_down_kernel``: the same grouped GEMM on ``h`` and the down weights, times the pair's
   routing weight; each row is stored (fp32) at its pair's place in ``[T * k, hidden]``.
4. ``_combine_kernel`` sums each token's ``k`` slots in a fixed order (deterministic: no
   atomics), adds the shared expert's output where the block has one (times the sigmoid of
   its gate, Qwen's), and rounds once to ``x``'s dtype.

Programs whose row block lies past the used ones return at once; padding rows are computed (on
zeros) but never stored by the second kernel. Accumulation is fp32 throughout.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from heron.kernels.moe_align import align_by_expert
from heron.kernels.pdl import pdl_launch, wait_for_previous_kernel
from heron.kernels.wna16 import dequant_tile

#: Values an MXFP4 scale covers (``heron.layers.mxfp4.BLOCK``; kernels import no layers).
MXFP4_BLOCK = 32

ACTIVATIONS = ("swiglu", "clamped_swiglu")


@triton.jit
def _expert_matmul(
    a_ptrs,
    a_mask,
    w_ptr,
    cols,
    n_mask,
    N,
    K,
    s_ptrs,
    z_ptr,
    p_ptr,
    OUTPUT_MAJOR: tl.constexpr,
    EVEN_K: tl.constexpr,
    SCALE: tl.constexpr,
    SCALE_BK: tl.constexpr,
    BITS: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_PERM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """fp32 ``a @ w[:, cols]`` [BLOCK_M, BLOCK_N] over ``K``: ``a_ptrs`` [BLOCK_M, 1] point at
    the rows' starts (``a_mask`` [BLOCK_M, 1] says which to read), ``w_ptr`` at one expert's
    weight, [N, K] if ``OUTPUT_MAJOR`` else [K, N]. With ``SCALE`` the weight is FP8 and
    ``s_ptrs`` [BLOCK_N] point at each column's scale (1) or at its row of tile scales (2);
    packed integers (4): ``s_ptrs`` and ``z_ptr`` at the expert's scales and zero points, and
    with ``HAS_PERM`` ``p_ptr`` at the expert's order of ``a``'s columns (act-order)."""
    if SCALE == 4:
        return _wna16_matmul(
            a_ptrs, a_mask, w_ptr, s_ptrs, z_ptr, p_ptr, cols, n_mask, K, BITS, SCALE_BK,
            HAS_ZEROS, HAS_PERM, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PREC,
        )  # fmt: skip
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptrs + offs_k[None, :]
    if SCALE == 3:
        return _mxfp4_matmul(
            a_ptrs, a_mask, w_ptr, cols, n_mask, K, s_ptrs, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PREC
        )
    if OUTPUT_MAJOR:
        stride_k, stride_n = 1, K
    else:
        stride_k, stride_n = N, 1
    w_ptrs = w_ptr + offs_k[:, None] * stride_k + cols[None, :] * stride_n
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=a_mask, other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[None, :], other=0.0)
        else:
            k_mask = (k + offs_k) < K
            a = tl.load(a_ptrs, mask=a_mask & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        w = w.to(a_ptrs.dtype.element_ty)
        if SCALE == 2:
            s = tl.load(s_ptrs + k // SCALE_BK, mask=n_mask, other=0.0)
            acc += tl.dot(a, w, input_precision=DOT_PREC) * s[None, :]
        else:
            acc = tl.dot(a, w, acc=acc, input_precision=DOT_PREC)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_k
    if SCALE == 1:
        acc *= tl.load(s_ptrs, mask=n_mask, other=0.0)[None, :]
    return acc


@triton.jit
def _mxfp4_matmul(
    a_ptrs,
    a_mask,
    w_ptr,
    cols,
    n_mask,
    K,
    s_ptrs,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """``_expert_matmul`` over MXFP4 weights: bytes [N, K / 2], ``s_ptrs`` at each column's
    E8M0 scales; ``BLOCK_K`` is one scale's 32 values, so a K step takes one scale a column."""
    offs_b = tl.arange(0, BLOCK_K // 2)
    b_ptrs = w_ptr + cols[:, None] * (K // 2) + offs_b[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        packed = tl.load(b_ptrs, mask=n_mask[:, None], other=0)
        w = _fp4_tile(packed, BLOCK_N, BLOCK_K).to(a_ptrs.dtype.element_ty)
        e8m0 = tl.load(s_ptrs + k // BLOCK_K, mask=n_mask, other=0).to(tl.int32)
        # 2 ** (e - 127) as fp32 bits (e = 0, 2 ** -127, reads as 0), times the tile's 2 ** 14
        scale = (e8m0 << 23).to(tl.float32, bitcast=True) * 16384.0
        acc += tl.dot(a, tl.trans(w), input_precision=DOT_PREC) * scale[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K // 2
    return acc


@triton.jit
def _wna16_matmul(
    a_ptrs,
    a_mask,
    w_ptr,
    s_ptr,
    z_ptr,
    p_ptr,
    cols,
    n_mask,
    K,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_PERM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """``_expert_matmul`` over one expert's packed integers: words [N, K * BITS / 32], scales
    and zero points [N, cdiv(K, GROUP)] (``GROUP`` at least ``K`` per channel); with
    ``HAS_PERM`` the weight's column ``k`` multiplies ``a``'s column ``perm[k]`` (act-order: the
    columns sorted by group at load). The weight tile's columns past ``K`` are not zero (see
    ``dequant_tile``); the activations there are."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = (k + offs_k) < K
        a_cols = k + offs_k
        if HAS_PERM:
            a_cols = tl.load(p_ptr + a_cols, mask=k_mask, other=0)
        a = tl.load(a_ptrs + a_cols[None, :], mask=a_mask & k_mask[None, :], other=0.0)
        w = dequant_tile(
            w_ptr, s_ptr, z_ptr, cols, n_mask, k, K, K // (32 // BITS), tl.cdiv(K, GROUP),
            BITS, GROUP, HAS_ZEROS, False, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc=acc, input_precision=DOT_PREC)
    return acc


@triton.jit
def _fp4_tile(packed, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """E2M1 values of bytes ``packed`` [BLOCK_N, BLOCK_K / 2] (the low nibble first) as fp16
    [BLOCK_N, BLOCK_K] times 2 ** -14, exactly: the nibble's exponent and mantissa bits become
    fp16's lowest exponent bits and top mantissa bit (exponent 0 a subnormal, as in E2M1)."""
    nibbles = tl.reshape(tl.join(packed & 0xF, packed >> 4), [BLOCK_N, BLOCK_K]).to(tl.uint16)
    bits = ((nibbles & 7) << 9) | ((nibbles & 8) << 12)
    return bits.to(tl.float16, bitcast=True)


@triton.jit
def _row_block(pid_m, block_expert_ptr, sorted_ids_ptr, num_pairs, BLOCK_M: tl.constexpr):
    """Row block ``pid_m``'s expert, its sorted row indices, their (token, slot) pairs and
    which rows are real (padding rows hold the sentinel ``num_pairs``)."""
    expert = tl.cast(tl.load(block_expert_ptr + pid_m), tl.int64)
    offs_m = tl.cast(pid_m, tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ids_ptr + offs_m)
    return expert, offs_m, pairs, pairs < num_pairs


@triton.jit
def _weight_offset(expert, size, SCALE: tl.constexpr, BITS: tl.constexpr):
    """Where expert ``expert``'s weight of ``size`` values starts (MXFP4: two a byte; packed
    integers: ``32 / BITS`` a word)."""
    if SCALE == 3:
        return expert * (size // 2)
    if SCALE == 4:
        return expert * (size // (32 // BITS))
    return expert * size


@triton.jit
def _scale_ptrs(s_ptr, expert, rows, num_rows, K, SCALE: tl.constexpr, SCALE_BK: tl.constexpr):
    """Pointers at the scales of one expert's weight ``rows`` [BLOCK_N] (output channels for
    ``SCALE`` 1; rows of tiles for 2 and 3, each ``cdiv(K, SCALE_BK)`` long) of ``num_rows``;
    for ``SCALE`` 0, unread pointers off the weight that stands in for the scales. Packed
    integers (4) take rows 0: the expert's first row of groups (of scales or zero points)."""
    if SCALE >= 2:
        return s_ptr + (expert * num_rows + rows) * tl.cdiv(K, SCALE_BK)
    return s_ptr + expert * num_rows + rows


@triton.jit
def _gate_up_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    s_ptr,
    z_ptr,
    p_ptr,
    h_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_blocks_ptr,
    num_pairs,
    top_k,
    hidden,
    inter,
    stride_x,
    alpha,
    limit,
    ACTIVATION: tl.constexpr,
    OUTPUT_MAJOR: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    SCALE: tl.constexpr,
    SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr,
    BITS: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_PERM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PREC: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """``h[rows, tile] = act(x[token(rows)] @ gate_up[e] (+ bias))`` for one row block."""
    wait_for_previous_kernel(USE_PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m >= tl.load(num_blocks_ptr):
        return
    expert, offs_m, pairs, valid = _row_block(
        pid_m, block_expert_ptr, sorted_ids_ptr, num_pairs, BLOCK_M
    )
    tokens = tl.cast(pairs // top_k, tl.int64)

    # Accumulator column c holds output j = pid_n * BLOCK_N / 2 + c // 2, its gate for even c,
    # its up for odd c; cols says which weight column that is.
    n_cols = 2 * inter
    offs_c = tl.arange(0, BLOCK_N)
    offs_j = pid_n * (BLOCK_N // 2) + offs_c // 2
    is_up = offs_c % 2
    if INTERLEAVED:
        cols = 2 * offs_j + is_up
    else:
        cols = is_up * inter + offs_j
    n_mask = offs_j < inter
    if SCALE == 2:  # tile rows: the gate's cdiv(inter, SCALE_BN), then the up's
        gate_tiles = tl.cdiv(inter, SCALE_BN)
        s_ptrs = _scale_ptrs(
            s_ptr, expert, is_up * gate_tiles + offs_j // SCALE_BN, 2 * gate_tiles, hidden,
            SCALE, SCALE_BK,
        )  # fmt: skip
    elif SCALE == 4:
        s_ptrs = _scale_ptrs(s_ptr, expert, 0, n_cols, hidden, SCALE, SCALE_BK)
    else:
        s_ptrs = _scale_ptrs(s_ptr, expert, cols, n_cols, hidden, SCALE, SCALE_BK)
    acc = _expert_matmul(
        x_ptr + tokens[:, None] * stride_x,
        valid[:, None],
        w_ptr + _weight_offset(expert, hidden * n_cols, SCALE, BITS),
        cols,
        n_mask,
        n_cols,
        hidden,
        s_ptrs,
        _scale_ptrs(z_ptr, expert, 0, n_cols, hidden, SCALE, SCALE_BK),
        p_ptr + expert * hidden,
        OUTPUT_MAJOR,
        EVEN_K,
        SCALE,
        SCALE_BK,
        BITS,
        HAS_ZEROS,
        HAS_PERM,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        DOT_PREC,
    )
    if HAS_BIAS:
        bias = tl.load(b_ptr + expert * n_cols + cols, mask=n_mask, other=0.0)
        acc += bias.to(tl.float32)[None, :]

    gate, up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N // 2, 2]))
    if ACTIVATION == "clamped_swiglu":  # heron.layers.moe.clamped_swiglu
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        glu = (up + 1.0) * (gate * tl.sigmoid(alpha * gate))
    else:
        glu = up * (gate * tl.sigmoid(gate))

    offs_h = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    h_ptrs = h_ptr + offs_m[:, None] * inter + offs_h[None, :]
    tl.store(h_ptrs, glu.to(h_ptr.dtype.element_ty), mask=(offs_h < inter)[None, :])


@triton.jit
def _down_kernel(
    h_ptr,
    w_ptr,
    b_ptr,
    s_ptr,
    z_ptr,
    route_ptr,
    out_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_blocks_ptr,
    num_pairs,
    inter,
    hidden,
    OUTPUT_MAJOR: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    SCALE: tl.constexpr,
    SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr,
    BITS: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PREC: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """``out[pair(rows), tile] = route(pair) * (h[rows] @ down[e] (+ bias))``, real rows only."""
    wait_for_previous_kernel(USE_PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m >= tl.load(num_blocks_ptr):
        return
    expert, offs_m, pairs, valid = _row_block(
        pid_m, block_expert_ptr, sorted_ids_ptr, num_pairs, BLOCK_M
    )

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden
    if SCALE == 2:
        rows, num_rows = offs_n // SCALE_BN, tl.cdiv(hidden, SCALE_BN)
    elif SCALE == 4:
        rows, num_rows = 0, hidden
    else:
        rows, num_rows = offs_n, hidden
    # Every row of a used block was written by the first kernel, padding rows too.
    acc = _expert_matmul(
        h_ptr + offs_m[:, None] * inter,
        offs_m[:, None] >= 0,
        w_ptr + _weight_offset(expert, inter * hidden, SCALE, BITS),
        offs_n,
        n_mask,
        hidden,
        inter,
        _scale_ptrs(s_ptr, expert, rows, num_rows, inter, SCALE, SCALE_BK),
        _scale_ptrs(z_ptr, expert, 0, num_rows, inter, SCALE, SCALE_BK),
        z_ptr,  # (no column order: act-order's is folded into gate_up's rows at load)
        OUTPUT_MAJOR,
        EVEN_K,
        SCALE,
        SCALE_BK,
        BITS,
        HAS_ZEROS,
        False,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        DOT_PREC,
    )
    if HAS_BIAS:
        bias = tl.load(b_ptr + expert * hidden + offs_n, mask=n_mask, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    route = tl.load(route_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
    acc *= route[:, None]

    out_ptrs = out_ptr + tl.cast(pairs, tl.int64)[:, None] * hidden + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _combine_kernel(
    slots_ptr,  # [T * k, hidden] fp32
    add_ptr,  # [T, hidden]
    gate_ptr,  # [T, 1]
    out_ptr,  # [T, hidden]
    hidden,
    stride_add,
    stride_gate,
    stride_out,
    TOP_K: tl.constexpr,
    HAS_ADD: tl.constexpr,
    HAS_GATE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``out[t] = sum_j slots[t * k + j] (+ add[t] (* sigmoid(gate[t])))``, summed in fp32."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(slots_ptr + (t * TOP_K + j) * hidden + cols, mask=mask, other=0.0)
    if HAS_ADD:
        shared = tl.load(add_ptr + t * stride_add + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_GATE:
            shared *= tl.sigmoid(tl.load(gate_ptr + t * stride_gate).to(tl.float32))
        acc += shared
    tl.store(out_ptr + t * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def combine_slots(
    per_slot: torch.Tensor,
    top_k: int,
    dtype: torch.dtype,
    add: torch.Tensor | None = None,
    add_gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[T * k, hidden]`` fp32 slots -> ``[T, hidden]`` in ``dtype``: each token's ``k`` slots
    summed, plus ``add`` [T, hidden] (scaled by ``sigmoid(add_gate)`` [T, 1] if given)."""
    hidden = per_slot.shape[1]
    num_tokens = per_slot.shape[0] // top_k
    if add is not None and (add.shape != (num_tokens, hidden) or add.stride(1) != 1):
        raise ValueError(f"combine_slots: add {tuple(add.shape)} is not [{num_tokens}, {hidden}]")
    if add_gate is not None and (add is None or add_gate.shape != (num_tokens, 1)):
        raise ValueError("combine_slots: add_gate must be [T, 1] beside an add")
    out = torch.empty(num_tokens, hidden, dtype=dtype, device=per_slot.device)
    block = min(1024, triton.next_power_of_2(hidden))
    if num_tokens:
        _combine_kernel[(num_tokens, triton.cdiv(hidden, block))](
            per_slot,
            per_slot if add is None else add,  # not read without an add
            per_slot if add_gate is None else add_gate,
            out,
            hidden,
            0 if add is None else add.stride(0),
            0 if add_gate is None else add_gate.stride(0),
            out.stride(0),
            TOP_K=top_k,
            HAS_ADD=add is not None,
            HAS_GATE=add_gate is not None,
            BLOCK=block,
            num_warps=4,
        )
    return out


def default_blocks(num_pairs: int, num_experts: int) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K)`` by the mean number of pairs per expert: small row blocks
    while few tokens reach each expert (decode), larger ones for prefill."""
    per_expert = num_pairs / num_experts
    if per_expert <= 16:
        return 16, 64, 64
    if per_expert <= 64:
        return 32, 64, 64
    return 64, 128, 64


def fused_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    activation: str,
    output_major: bool,
    interleaved: bool,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    alpha: float = 0.0,
    limit: float = 0.0,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
    scale_block: tuple[int, int] | None = None,
    gate_up_zeros: torch.Tensor | None = None,
    down_zeros: torch.Tensor | None = None,
    bits: int | None = None,
    group_size: int | None = None,
    input_perm: torch.Tensor | None = None,
    blocks: tuple[int, int, int] | None = None,
    add: torch.Tensor | None = None,
    add_gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """The experts on ``x`` [T, hidden]: the sum over each token's experts ``indices`` [T, k]
    of ``weights`` [T, k] times the expert's gated MLP, plus ``add`` [T, hidden] (a shared
    expert's output, scaled by ``sigmoid(add_gate)`` [T, 1] if given); returns [T, hidden].

    ``activation`` is one of ``ACTIVATIONS`` (``alpha`` and ``limit`` are the clamped one's).
    With ``output_major`` the weights are ``gate_up`` [E, 2I, hidden] and ``down`` [E, hidden,
    I], else ``gate_up`` [E, hidden, 2I] and ``down`` [E, I, hidden]; ``interleaved`` says the
    gate and up outputs alternate rather than form halves. Biases are [E, 2I] and [E, hidden].
    With ``gate_up_scale`` and ``down_scale`` the weights are FP8 E4M3 times fp32 scales: per
    output channel ([E, 2I], [E, hidden]), or with ``scale_block`` ``(bn, bk)`` per tile of an
    output-major ``[gate | up]`` weight ([E, 2 cdiv(I, bn), cdiv(hidden, bk)], the gate's rows
    of tiles then the up's; [E, cdiv(hidden, bn), cdiv(I, bk)]). MXFP4 weights are uint8
    blocks of output-major matrices, ``[E, 2I, hidden / 32, 16]`` and ``[E, hidden, I / 32,
    16]``, with uint8 E8M0 scales ``[E, 2I, hidden / 32]`` and ``[E, hidden, I / 32]`` (a K step
    is then 32 values). With ``bits`` (4 or 8) the weights are packed integers, output-major
    int32 words ``[E, 2I, hidden * bits / 32]`` and ``[E, hidden, I * bits / 32]`` with scales
    ``[E, 2I, G]`` and ``[E, hidden, G']`` per ``group_size`` inputs (None: one per channel)
    and uint8 ``gate_up_zeros`` / ``down_zeros`` of the scales' shapes (None: symmetric,
    ``2 ** (bits - 1)``); act-order ones take ``x``'s columns in each expert's ``input_perm``
    order (int32 [E, hidden]). ``blocks`` overrides
    ``(BLOCK_M, BLOCK_N, BLOCK_K)`` (each a power of two of at least 16).
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"fused_experts: activation {activation!r} is not one of {ACTIVATIONS}")
    if bits not in (None, 4, 8):
        raise ValueError(f"fused_experts: packed integers of {bits} bits (4 or 8)")
    num_experts = gate_up.shape[0]
    n_cols, hidden = _out_in(gate_up, output_major, bits)
    inter = n_cols // 2
    num_tokens, top_k = indices.shape
    if (
        x.shape != (num_tokens, hidden)
        or down.shape[0] != num_experts
        or _out_in(down, output_major, bits) != (hidden, inter)
    ):
        raise ValueError(
            f"fused_experts: x {tuple(x.shape)}, indices {tuple(indices.shape)}, gate_up "
            f"{tuple(gate_up.shape)}, down {tuple(down.shape)} (output_major={output_major})"
        )
    if (gate_up_bias is None) != (down_bias is None):
        raise ValueError("fused_experts: give both biases or neither")
    if scale_block is not None and (interleaved or not output_major):
        raise ValueError("fused_experts: tile scales need output-major [gate | up] weights")
    if bits is not None:
        scale = _check_wna16(
            (gate_up, down), (gate_up_scale, down_scale), (gate_up_zeros, down_zeros), group_size,
            (hidden, inter),
            output_major and not interleaved and gate_up_bias is None and scale_block is None,
        )  # fmt: skip
    else:
        scale = _check_weights(
            x, (gate_up, down), (gate_up_bias, down_bias), (gate_up_scale, down_scale),
            scale_block, output_major,
        )  # fmt: skip
    if input_perm is not None and (
        bits is None or input_perm.shape != (num_experts, hidden) or input_perm.dtype != torch.int32
        or not input_perm.is_contiguous()
    ):  # fmt: skip
        raise ValueError(
            f"fused_experts: input_perm is a contiguous int32 [{num_experts}, {hidden}] beside "
            "packed integer weights"
        )
    if x.stride(1) != 1:
        x = x.contiguous()
    if num_tokens == 0:
        return torch.zeros_like(x)
    num_pairs = num_tokens * top_k
    block_m, block_n, block_k = blocks or default_blocks(num_pairs, num_experts)
    scale_bn, scale_bk = scale_block or ((1, MXFP4_BLOCK) if scale == 3 else (1, 1))
    if scale in (2, 3):
        block_k = min(block_k, scale_bk)  # one tile of scales per K step
    if scale == 4:  # a group per channel spans both matrices' inputs and a K step
        scale_bk = group_size or triton.next_power_of_2(max(hidden, inter, block_k))
    sorted_ids, block_expert, num_blocks = align_by_expert(indices, num_experts, block_m)
    max_blocks = block_expert.numel()
    has_bias = gate_up_bias is not None
    common = dict(
        OUTPUT_MAJOR=output_major,
        HAS_BIAS=has_bias,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SCALE=scale,
        SCALE_BN=scale_bn,
        SCALE_BK=scale_bk,
        BITS=bits or 32,
        HAS_ZEROS=gate_up_zeros is not None,
        DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=4,
        num_stages=2 if x.dtype == torch.float32 else 3,
        **pdl_launch(x.device),
    )

    h = torch.empty(sorted_ids.numel(), inter, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(max_blocks, triton.cdiv(n_cols, block_n))](
        x,
        gate_up,
        gate_up_bias,
        gate_up if gate_up_scale is None else gate_up_scale,  # not read without scales
        gate_up if gate_up_zeros is None else gate_up_zeros,  # nor without zero points
        gate_up if input_perm is None else input_perm,  # nor without an order
        h,
        sorted_ids,
        block_expert,
        num_blocks,
        num_pairs,
        top_k,
        hidden,
        inter,
        x.stride(0),
        alpha,
        limit,
        ACTIVATION=activation,
        INTERLEAVED=interleaved,
        HAS_PERM=input_perm is not None,
        EVEN_K=hidden % block_k == 0,
        **common,
    )

    per_slot = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
    _down_kernel[(max_blocks, triton.cdiv(hidden, block_n))](
        h,
        down,
        down_bias,
        down if down_scale is None else down_scale,
        down if down_zeros is None else down_zeros,
        weights.contiguous(),
        per_slot,
        sorted_ids,
        block_expert,
        num_blocks,
        num_pairs,
        inter,
        hidden,
        EVEN_K=inter % block_k == 0,
        **common,
    )
    return combine_slots(per_slot, top_k, x.dtype, add, add_gate)


def _out_in(w: torch.Tensor, output_major: bool, bits: int | None) -> tuple[int, int]:
    """(output, input) features of one expert's matrix in stack ``w``: MXFP4 blocks (uint8
    ``[E, N, K / 32, 16]``), ``bits``-bit packed words (``[E, N, K * bits / 32]``), or values
    ``[E, out, in]`` (``output_major``) or ``[E, in, out]``."""
    if w.dtype == torch.uint8:
        return w.shape[1], w.shape[2] * MXFP4_BLOCK
    if bits is not None:
        return w.shape[1], w.shape[2] * (32 // bits)
    return tuple(w.shape[1:]) if output_major else (w.shape[2], w.shape[1])


def _check_weights(
    x: torch.Tensor,
    weights: tuple[torch.Tensor, torch.Tensor],
    biases: tuple[torch.Tensor | None, torch.Tensor | None],
    scales: tuple[torch.Tensor | None, torch.Tensor | None],
    block: tuple[int, int] | None,
    output_major: bool,
) -> int:
    """The kernels' ``SCALE`` for these weights; raises unless they are contiguous and in
    ``x``'s dtype (0), or FP8 with contiguous fp32 scales of the layout's shapes (1, 2)."""
    for b in biases:
        if b is not None and (not b.is_contiguous() or b.dtype != x.dtype):
            raise ValueError("fused_experts: expert biases must be contiguous, in x's dtype")
    if any(w.dtype == torch.uint8 for w in weights):
        return _check_mxfp4(weights, scales, block, output_major)
    if scales == (None, None):
        if block is not None or any(w.dtype != x.dtype or not w.is_contiguous() for w in weights):
            raise ValueError(
                "fused_experts: expert weights must be contiguous, in x's dtype (or FP8 with "
                "gate_up_scale and down_scale)"
            )
        return 0
    if block is not None and (len(block) != 2 or block[1] < 16 or any(b & (b - 1) for b in block)):
        raise ValueError(
            f"fused_experts: scale_block {block} is not two powers of two with bk >= 16"
        )
    expected = []
    for w, rows in zip(weights, (2, 1), strict=True):  # gate_up holds two matrices' tiles
        num_experts, n, k = w.shape if output_major else (w.shape[0], w.shape[2], w.shape[1])
        if block is None:
            expected.append((num_experts, n))
        else:
            n_tiles = -(-(n // rows) // block[0]) * rows
            expected.append((num_experts, n_tiles, -(-k // block[1])))
    for which, w, s, shape in zip(("gate_up", "down"), weights, scales, expected, strict=True):
        if (
            s is None
            or w.dtype != torch.float8_e4m3fn
            or not w.is_contiguous()
            or s.dtype != torch.float32
            or not s.is_contiguous()
            or tuple(s.shape) != shape
        ):
            raise ValueError(
                f"fused_experts: FP8 {which} weights are contiguous float8_e4m3fn with contiguous "
                f"fp32 scales of shape {shape}; got {w.dtype} and "
                f"{None if s is None else (s.dtype, tuple(s.shape))}"
            )
    return 2 if block is not None else 1


def _check_mxfp4(
    weights: tuple[torch.Tensor, torch.Tensor],
    scales: tuple[torch.Tensor | None, torch.Tensor | None],
    block: tuple[int, int] | None,
    output_major: bool,
) -> int:
    """``SCALE`` 3 for MXFP4 stacks: output-major contiguous uint8 blocks ``[E, N, K / 32, 16]``
    with contiguous uint8 scales ``[E, N, K / 32]``; raises otherwise."""
    for which, w, s in zip(("gate_up", "down"), weights, scales, strict=True):
        if (
            block is not None
            or not output_major
            or w.dtype != torch.uint8
            or w.dim() != 4
            or w.shape[3] != MXFP4_BLOCK // 2
            or not w.is_contiguous()
            or s is None
            or s.dtype != torch.uint8
            or not s.is_contiguous()
            or s.shape != w.shape[:3]
        ):
            raise ValueError(
                f"fused_experts: MXFP4 {which} weights are output-major contiguous uint8 blocks "
                f"[E, N, K / 32, 16] with contiguous uint8 scales [E, N, K / 32]; got "
                f"{w.dtype} {tuple(w.shape)} and {None if s is None else (s.dtype, tuple(s.shape))}"
            )
    return 3


def _check_wna16(
    weights: tuple[torch.Tensor, torch.Tensor],
    scales: tuple[torch.Tensor | None, torch.Tensor | None],
    zeros: tuple[torch.Tensor | None, torch.Tensor | None],
    group_size: int | None,
    inputs: tuple[int, int],
    plain_layout: bool,
) -> int:
    """``SCALE`` 4 for packed integer stacks: output-major ``[gate | up]`` without biases or
    tile scales,
    contiguous int32 words with contiguous scales (and uint8 zero points for both or neither)
    of ``[E, N, groups of the input]``; raises otherwise."""
    if not plain_layout:
        raise ValueError(
            "fused_experts: packed integer experts are output-major [gate | up] without biases"
        )
    if (zeros[0] is None) != (zeros[1] is None):
        raise ValueError("fused_experts: give both zero points or neither")
    for which, w, s, z, k in zip(("gate_up", "down"), weights, scales, zeros, inputs, strict=True):
        shape = (*w.shape[:2], -(-k // (group_size or k)))
        if (
            w.dtype != torch.int32
            or not w.is_contiguous()
            or s is None
            or not s.is_contiguous()
            or tuple(s.shape) != shape
            or (
                z is not None
                and (z.dtype != torch.uint8 or z.shape != s.shape or not z.is_contiguous())
            )
        ):
            raise ValueError(
                f"fused_experts: packed {which} weights are contiguous int32 words with "
                f"contiguous scales (and uint8 zero points) of shape {shape}; got {w.dtype} "
                f"{tuple(w.shape)} and {None if s is None else (s.dtype, tuple(s.shape))}"
            )
    return 4
