"""A router's rule in one Triton launch: each token's top-k experts and their weights; and the
fp32 router product of DeepSeek's routers in one launch for decode-sized batches.

``heron.layers.routing.Routing.select`` spells the rules in PyTorch (softmax, top-k, gathers,
group masks, renormalisation: eight to fifteen small kernels per MoE layer, which at decode cost
more than the experts read). Here one program per token holds its ``E`` logits in registers and
does the rule: scores, the eligible groups (each group's best score, or its two best biased
scores summed), ``top_k`` rounds of arg-max (the lowest index among equals), then the weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

SCORINGS = {"softmax": 0, "softmax_of_topk": 1, "sigmoid": 2}
MAX_EXPERTS = 1024
#: Past this many tokens the router product is a GEMM's work: cuBLAS takes it.
ROUTER_KERNEL_MAX_TOKENS = 64


@triton.jit
def _router_logits_kernel(
    x_ptr,  # [T, hidden], any float dtype
    w_ptr,  # [E, hidden] fp32
    b_ptr,  # [E] fp32
    out_ptr,  # [T, E] fp32
    hidden,
    num_experts,
    stride_x,
    HAS_BIAS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    experts = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_mask = experts < num_experts
    acc = tl.zeros([BLOCK_E, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < hidden
        x = tl.load(x_ptr + t * stride_x + ks, mask=k_mask, other=0.0).to(tl.float32)
        w_ptrs = w_ptr + experts[:, None].to(tl.int64) * hidden + ks[None, :]
        w = tl.load(w_ptrs, mask=e_mask[:, None] & k_mask[None, :], other=0.0)
        acc += w * x[None, :]
    logits = tl.sum(acc, axis=1)
    if HAS_BIAS:
        logits += tl.load(b_ptr + experts, mask=e_mask, other=0.0)
    tl.store(out_ptr + t * num_experts + experts, logits, mask=e_mask)


def router_logits(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x.float(), weight, bias)`` for an fp32 router ``weight`` [E, hidden] (HF
    DeepSeek's product): one launch up to ``ROUTER_KERNEL_MAX_TOKENS`` rows, where the cast
    and cuBLAS's split product take three; cuBLAS past it."""
    num_tokens, hidden = x.shape
    if weight.dtype != torch.float32 or (bias is not None and bias.dtype != torch.float32):
        raise ValueError("router_logits: the router weight and bias must be fp32")
    if num_tokens > ROUTER_KERNEL_MAX_TOKENS or x.stride(1) != 1 or not weight.is_contiguous():
        return F.linear(x.float(), weight, bias)
    num_experts = weight.shape[0]
    out = torch.empty(num_tokens, num_experts, dtype=torch.float32, device=x.device)
    block_e = 2 if num_tokens <= 16 else 8  # enough programs to spread a few rows' reads
    if num_tokens:
        _router_logits_kernel[(num_tokens, triton.cdiv(num_experts, block_e))](
            x,
            weight,
            weight if bias is None else bias,  # not read without a bias
            out,
            hidden,
            num_experts,
            x.stride(0),
            HAS_BIAS=bias is not None,
            BLOCK_E=block_e,
            BLOCK_K=min(512, triton.next_power_of_2(hidden)),
            num_warps=4,
        )
    return out


@triton.jit
def _arg_max(values, offs, NONE: tl.constexpr):
    """The largest of ``values`` and its lowest index."""
    best = tl.max(values, axis=0)
    return best, tl.min(tl.where(values == best, offs, NONE), axis=0)


@triton.jit
def _route_kernel(
    logits_ptr,
    bias_ptr,
    weights_ptr,
    indices_ptr,
    num_experts,
    group_size,
    stride_t,
    scaling,
    SCORING: tl.constexpr,  # SCORINGS
    HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    TOP_K: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    TOPK_GROUPS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    token = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    real = offs < num_experts
    row = logits_ptr + tl.cast(token, tl.int64) * stride_t
    logits = tl.load(row + offs, mask=real, other=float("-inf")).to(tl.float32)
    if SCORING == 0:
        exp = tl.exp(logits - tl.max(logits, axis=0))
        scores = exp / tl.sum(exp, axis=0)
    elif SCORING == 1:
        scores = logits
    else:
        scores = tl.where(real, tl.sigmoid(logits), 0.0)
    choice = tl.where(real, scores, float("-inf"))
    if HAS_BIAS:
        choice += tl.load(bias_ptr + offs, mask=real, other=0.0).to(tl.float32)

    if NUM_GROUPS > 1:
        group = offs // group_size
        offs_g = tl.arange(0, BLOCK_G)
        group_scores = tl.full([BLOCK_G], float("-inf"), tl.float32)
        for g in tl.static_range(NUM_GROUPS):
            members = tl.where(group == g, choice, float("-inf"))
            best, at = _arg_max(members, offs, BLOCK_E)
            if SCORING == 2:  # the two best biased scores
                best += tl.max(tl.where(offs == at, float("-inf"), members), axis=0)
            group_scores = tl.where(offs_g == g, best, group_scores)
        eligible = offs < 0
        for _ in tl.static_range(TOPK_GROUPS):
            _, g = _arg_max(group_scores, offs_g, BLOCK_G)
            eligible |= group == g
            group_scores = tl.where(offs_g == g, float("-inf"), group_scores)
        # Outside the kept groups: 0 for softmax scores, -inf for sigmoid ones (as HF fills).
        choice = tl.where(eligible, choice, 0.0 if SCORING == 0 else float("-inf"))
        choice = tl.where(real, choice, float("-inf"))

    offs_k = tl.arange(0, BLOCK_K)
    picked = tl.zeros([BLOCK_K], dtype=tl.float32)
    chosen = tl.zeros([BLOCK_K], dtype=tl.int64)
    for slot in tl.static_range(TOP_K):
        _, at = _arg_max(choice, offs, BLOCK_E)
        picked = tl.where(offs_k == slot, tl.sum(tl.where(offs == at, scores, 0.0), axis=0), picked)
        chosen = tl.where(offs_k == slot, at.to(tl.int64), chosen)
        choice = tl.where(offs == at, float("-inf"), choice)
    used = offs_k < TOP_K
    if SCORING == 1:  # a softmax over the chosen logits alone
        exp = tl.where(used, tl.exp(picked - tl.max(tl.where(used, picked, float("-inf")))), 0.0)
        picked = exp / tl.sum(exp, axis=0)
    elif RENORMALIZE:
        picked = picked / (tl.sum(tl.where(used, picked, 0.0), axis=0) + 1e-20)
    out = tl.cast(token, tl.int64) * TOP_K + offs_k
    tl.store(weights_ptr + out, (picked * scaling).to(weights_ptr.dtype.element_ty), mask=used)
    tl.store(indices_ptr + out, chosen, mask=used)


def route_topk(
    logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    *,
    top_k: int,
    scoring: str,
    renormalize: bool,
    num_groups: int,
    topk_groups: int,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, indices)`` [T, top_k] of router ``logits`` [T, E] under a ``Routing``'s
    fields (its meaning, computed in fp32; the weights in the logits' dtype, the indices
    int64 in descending order of choice)."""
    num_tokens, num_experts = logits.shape
    if scoring not in SCORINGS or num_experts > MAX_EXPERTS or num_experts % num_groups:
        raise ValueError(
            f"route_topk: scoring {scoring!r}, {num_experts} experts in {num_groups} groups"
        )
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    weights = torch.empty(num_tokens, top_k, dtype=logits.dtype, device=logits.device)
    indices = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    if num_tokens:
        _route_kernel[(num_tokens,)](
            logits,
            correction_bias if correction_bias is not None else logits,
            weights,
            indices,
            num_experts,
            num_experts // num_groups,
            logits.stride(0),
            scaling,
            SCORING=SCORINGS[scoring],
            HAS_BIAS=correction_bias is not None,
            RENORMALIZE=renormalize,
            TOP_K=top_k,
            NUM_GROUPS=num_groups,
            TOPK_GROUPS=topk_groups,
            BLOCK_E=triton.next_power_of_2(num_experts),
            BLOCK_K=triton.next_power_of_2(top_k),
            BLOCK_G=triton.next_power_of_2(num_groups),
        )
    return weights, indices
