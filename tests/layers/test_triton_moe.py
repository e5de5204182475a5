"""The fused Triton MoE (heron.kernels.moe) against the experts' sparse reference, for both
expert banks (plain SwiGLU in HF's layout, gpt-oss's clamped SwiGLU): tiny shapes under the
Triton interpreter on the CPU; on a GPU, gpt-oss-20b's and Qwen3-30B-A3B's shapes (bf16, and
fp32) against an fp64 reference and CUDA-graph replays with changing routing."""

from __future__ import annotations

import copy

import pytest
import torch
from triton_lowering import check_lowering

from heron.kernels import moe_align
from heron.kernels.moe import fused_experts
from heron.kernels.moe_align import align_by_expert
from heron.layers.moe import ClampedSwiGLUExperts, SparseMoE, SwiGLUExperts
from heron.layers.routing import Routing
from heron.models.gpt_oss import gpt_oss_moe
from heron.ops.selector import layer_kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LIMIT = 7.0


def make_experts(
    num_experts, hidden, inter, dtype, device=DEVICE, seed=0, kernels="torch", kind="clamped"
):
    """Random experts of ``kind`` (``clamped``: gpt-oss's, whose gate_up outputs reach well
    past the clamp for unit-scale inputs; ``swiglu``: plain, HF's layout)."""
    g = torch.Generator(device).manual_seed(seed)
    with torch.device(device):
        if kind == "clamped":
            experts = ClampedSwiGLUExperts(
                num_experts, hidden, inter, LIMIT, kernels=layer_kernels(kernels)
            )
            std = {"gate_up_proj": 3.5 / hidden**0.5, "down_proj": 1.0 / inter**0.5}
        else:
            experts = SwiGLUExperts(num_experts, hidden, inter, layer_kernels(kernels))
            std = {"gate_up_proj": 1.0 / hidden**0.5, "down_proj": 1.0 / inter**0.5}
    with torch.no_grad():
        for name, p in experts.named_parameters():
            p.normal_(0.0, std.get(name, 0.5), generator=g)
    return experts.to(dtype)


def converted(experts, dtype):
    """A copy of ``experts`` in ``dtype`` (the same values, rounded or widened)."""
    return copy.deepcopy(experts).to(dtype)


def route(num_tokens, num_experts, top_k, kind, device=DEVICE, seed=0):
    """Routing ``(weights, indices)`` [T, k], the weights a softmax over the k slots.

    ``random``: k distinct random experts. ``skewed``: every token's first expert is expert 1,
    the others among experts 2..k+1, so expert 0 and those past k+1 get no tokens. ``one``:
    every token's experts are the last k.
    """
    g = torch.Generator(device).manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=g, device=device)
    if kind == "skewed":
        logits[:, 0] = logits[:, top_k + 2 :] = -1e9
        logits[:, 1] = 1e9
    elif kind == "one":
        logits[:, num_experts - top_k :] += 1e9
    indices = logits.topk(top_k, dim=-1).indices
    weights = torch.softmax(torch.randn(num_tokens, top_k, generator=g, device=device), dim=-1)
    return weights, indices


def run_fused(experts, x, weights, indices, blocks=None):
    return fused_experts(x, weights, indices, **experts.fused_layout(), blocks=blocks)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.abs().max()).item()


def clamps_bite(experts, x) -> bool:
    """For clamped experts, whether some gate/up output of ``x`` is well past the clamp."""
    if not isinstance(experts, ClampedSwiGLUExperts):
        return True
    gate_up = torch.einsum("th,ehi->eti", x.double(), experts.gate_up_proj.double())
    return gate_up.abs().max().item() > 2 * experts.limit


@pytest.fixture(params=["one program", "torch"])
def align_path(request, monkeypatch):
    """Both ways of aligning: the one-program kernel, and PyTorch ops (past its pairs)."""
    if request.param == "torch":
        monkeypatch.setattr(moe_align, "ONE_PROGRAM_PAIRS", 0)
    return request.param


def test_align_by_expert(align_path):
    """Each used block holds one expert's pairs in token order, padding rows the sentinel."""
    num_experts, block_m = 5, 16
    indices = torch.tensor([[3, 0]] * 20 + [[0, 2]] * 3 + [[2, 3]])  # expert 1 and 4 get none
    sorted_ids, block_expert, num_blocks = align_by_expert(indices.to(DEVICE), num_experts, block_m)
    sorted_ids, block_expert, num_blocks = sorted_ids.cpu(), block_expert.cpu(), num_blocks.cpu()
    num_pairs = indices.numel()
    assert sorted_ids.numel() == block_m * block_expert.numel()
    assert sorted_ids.numel() >= num_pairs + 3 * (block_m - 1)
    # Expert 0: 23 pairs (2 blocks), expert 2: 4 (1 block), expert 3: 21 (2 blocks).
    assert num_blocks.tolist() == [5]
    assert block_expert[:5].tolist() == [0, 0, 2, 3, 3]
    rows = sorted_ids.view(-1, block_m)
    flat = indices.flatten()
    for b in range(5):
        real = rows[b][rows[b] < num_pairs]
        assert (flat[real.long()] == block_expert[b]).all()
    for e in range(num_experts):
        mine = sorted_ids[sorted_ids < num_pairs].long()
        mine = mine[flat[mine] == e]
        assert mine.tolist() == (flat == e).nonzero().flatten().tolist()
    assert (sorted_ids[5 * block_m :] == num_pairs).all()
    assert sorted(sorted_ids[sorted_ids < num_pairs].tolist()) == list(range(num_pairs))


def test_one_token_gets_a_block_per_pair():
    """Batch-1 decode: each of the token's pairs is a block of its own, whatever the experts."""
    block_m = 16
    for row in ([5, 1, 60, 2, 33, 0], [3, 3]):  # (duplicates too: still a valid layout)
        indices = torch.tensor([row], device=DEVICE)
        sorted_ids, block_expert, num_blocks = align_by_expert(indices, 64, block_m)
        k = len(row)
        assert num_blocks.tolist() == [k] and block_expert.tolist() == row
        rows = sorted_ids.view(k, block_m).cpu()
        assert rows[:, 0].tolist() == list(range(k)) and (rows[:, 1:] == k).all()


@pytest.mark.parametrize(
    "num_tokens,top_k,num_experts,block_m",
    [(2, 6, 64, 16), (7, 2, 5, 16), (40, 6, 160, 32), (100, 2, 3, 64)],  # one tile, several
)
def test_one_program_alignment_equals_torch(num_tokens, top_k, num_experts, block_m):
    """Random routings, experts not a power of two, pairs over several of the kernel's tiles."""
    g = torch.Generator().manual_seed(num_tokens)
    indices = torch.rand(num_tokens, num_experts, generator=g).topk(top_k, dim=-1).indices
    indices = indices.to(DEVICE)
    got = align_by_expert(indices, num_experts, block_m)
    want = moe_align._align_with_torch(indices.flatten(), num_experts, block_m, got[0].numel())
    for g_part, w_part in zip(got, want):
        assert torch.equal(g_part, w_part)


@pytest.mark.parametrize("num_tokens", [1, 5, 13])
@pytest.mark.parametrize("kind", ["random", "skewed"])
@pytest.mark.parametrize(
    "hidden,inter,blocks",
    [
        (32, 16, None),  # the default blocks: one tile, K tails
        (32, 16, (16, 16, 16)),  # two gate_up tiles, two down tiles, two K steps
        (40, 24, (16, 32, 16)),  # column and K tails in both kernels
    ],
)
@pytest.mark.parametrize("bank", ["clamped", "swiglu"])
def test_matches_sparse_reference(num_tokens, kind, hidden, inter, blocks, bank):
    experts = make_experts(4, hidden, inter, torch.float32, kind=bank)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(num_tokens))
    x = 2 * x.to(DEVICE)
    weights, indices = route(num_tokens, 4, 2, kind, seed=num_tokens)
    assert clamps_bite(experts, x)
    want = experts.forward_sparse(x, weights, indices)
    got = run_fused(experts, x, weights, indices, blocks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("num_tokens", [5, 40])
@pytest.mark.parametrize("bank", ["clamped", "swiglu"])
def test_one_expert_gets_every_token(num_tokens, bank):
    """k = 1 and every token on one expert: that expert's rows span several blocks."""
    experts = make_experts(4, 32, 16, torch.float32, kind=bank)
    x = 2 * torch.randn(num_tokens, 32, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    weights, indices = route(num_tokens, 4, 1, "one")
    assert (indices == 3).all()
    want = experts.forward_sparse(x, weights, indices)
    got = run_fused(experts, x, weights, indices, (16, 16, 16))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("bank", ["clamped", "swiglu"])
def test_fp16_strided_input(bank):
    experts = make_experts(4, 32, 16, torch.float16, kind=bank)
    x = torch.randn(13, 64, generator=torch.Generator().manual_seed(2)).half().to(DEVICE)
    x = x[:, 16:48]  # rows 64 apart
    weights, indices = route(13, 4, 2, "random")
    weights = weights.half()
    assert x.stride(0) == 64
    want = converted(experts, torch.float32).forward_sparse(x.float(), weights.float(), indices)
    got = run_fused(experts, x, weights, indices)
    assert got.dtype == torch.float16
    assert rel_err(got, want) < 5e-3


@pytest.mark.parametrize("gated", [False, True])
def test_shared_expert_output_is_added_with_the_sum(gated):
    """``add`` (a shared expert's output, Qwen's scaled by the sigmoid of its gate) joins the
    sum of the routed experts in the same launch, as the module's torch path adds it."""
    experts = make_experts(4, 32, 16, torch.float32, kind="swiglu")
    g = torch.Generator(DEVICE).manual_seed(3)
    x = torch.randn(5, 32, generator=g, device=DEVICE)
    shared = torch.randn(5, 32, generator=g, device=DEVICE)
    gate = torch.randn(5, 1, generator=g, device=DEVICE) if gated else None
    weights, indices = route(5, 4, 2, "random")
    want = experts(x, weights, indices, shared, gate)  # the torch path
    routed = experts.forward_sparse(x, weights, indices)
    torch.testing.assert_close(want, routed + (shared if gate is None else gate.sigmoid() * shared))
    got = fused_experts(x, weights, indices, **experts.fused_layout(), add=shared, add_gate=gate)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_no_tokens():
    experts = make_experts(4, 32, 16, torch.float32)
    weights, indices = route(0, 4, 2, "random")
    out = run_fused(experts, torch.zeros(0, 32, device=DEVICE), weights, indices)
    assert out.shape == (0, 32)


# (bank, experts, top-k, hidden, intermediate): gpt-oss-20b's and Qwen3-30B-A3B's experts.
SHAPES = {"gpt-oss-20b": ("clamped", 32, 4, 2880, 2880), "qwen3-30b-a3b": ("swiglu", 128, 8, 2048, 768)}  # fmt: skip


@pytest.fixture(scope="module", params=list(SHAPES))
def real_experts(request):
    """The shape's bf16 and fp32 experts, each with an fp64 copy (the reference)."""
    bank, num_experts, top_k, hidden, inter = SHAPES[request.param]
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        experts = make_experts(
            num_experts, hidden, inter, dtype, device="cuda", kernels="triton", kind=bank
        )
        out[dtype] = experts, converted(experts, torch.float64)
    return out, num_experts, top_k, hidden


def reference(ref, x, weights, indices):
    """The sparse reference in fp64 on the same (rounded) weights and inputs."""
    return ref.forward_sparse(x.double(), weights.double(), indices)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 300])
@pytest.mark.parametrize("kind", ["random", "skewed"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_real_shapes(real_experts, num_tokens, kind, dtype):
    banks, num_experts, top_k, hidden = real_experts
    experts, ref = banks[dtype]
    g = torch.Generator("cuda").manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden, generator=g, device="cuda").to(dtype)
    weights, indices = route(num_tokens, num_experts, top_k, kind, device="cuda", seed=num_tokens)
    weights = weights.to(dtype)
    assert clamps_bite(experts, x)
    got = experts(x, weights, indices)  # the module built with the Triton kernels
    assert got.dtype == dtype
    assert rel_err(got, reference(ref, x, weights, indices)) < (
        1e-2 if dtype == torch.bfloat16 else 1e-4
    )


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 300])
def test_gpu_cuda_graph_replay_with_new_routing(real_experts, num_tokens):
    """The experts captured once replay right for other inputs and other routings."""
    banks, num_experts, top_k, hidden = real_experts
    experts, ref = banks[torch.bfloat16]
    x = torch.zeros(num_tokens, hidden, dtype=torch.bfloat16, device="cuda")
    weights, indices = route(num_tokens, num_experts, top_k, "random", device="cuda")
    weights = weights.to(torch.bfloat16)
    experts(x, weights, indices)  # eager warm-up compiles the kernels
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = experts(x, weights, indices)
    for seed, kind in [(1, "random"), (2, "skewed"), (3, "random")]:
        g = torch.Generator("cuda").manual_seed(seed)
        x.copy_(torch.randn(num_tokens, hidden, generator=g, device="cuda"))
        new_weights, new_indices = route(
            num_tokens, num_experts, top_k, kind, device="cuda", seed=seed
        )
        weights.copy_(new_weights)
        indices.copy_(new_indices)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, experts(x, weights, indices))
        assert rel_err(out, reference(ref, x, weights, indices)) < 1e-2


def _qwen3_30b_block() -> SparseMoE:
    routing = Routing(8, "softmax", renormalize=True)
    return SparseMoE.swiglu(2048, 128, 768, routing, kernels=layer_kernels("triton"))


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["gpt-oss-20b", "qwen3-30b-a3b", "qwen3-next-shared"])
def test_gpu_cuda_graph_moe_block(family):
    """The whole block (router, top-k, weights, experts, shared expert) captured: a new ``x``
    routes anew, and the replay equals an eager call."""
    torch.manual_seed(0)
    kernels = layer_kernels("triton")
    if family == "gpt-oss-20b":
        moe, hidden = gpt_oss_moe(2880, 2880, 32, 4, LIMIT, kernels), 2880
    elif family == "qwen3-30b-a3b":
        moe, hidden = _qwen3_30b_block(), 2048
    else:  # Qwen3-Next-80B-A3B's block: 512 experts top-10 of width 512, gated shared expert
        routing = Routing(10, "softmax", renormalize=True)
        moe = SparseMoE.swiglu(
            2048, 512, 512, routing, shared_intermediate_size=512, gated_shared_expert=True,
            kernels=kernels,
        )  # fmt: skip
        hidden = 2048
    moe = moe.cuda()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.5 if p.dim() == 1 else 2.0 / hidden**0.5)
    moe = moe.to(torch.bfloat16)
    x = torch.randn(8, hidden, dtype=torch.bfloat16, device="cuda")
    moe(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe(x)
    routings = []
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, moe(x))
        routings.append(moe.gate(x)[1])
    assert not torch.equal(routings[0], routings[1])


def moe_launches() -> None:
    """bf16 launches at gpt-oss-20b's and Qwen3-30B-A3B's expert sizes, for a decode-sized and
    a prefill-sized batch (different row blocks), with and without LoRA addends, for the
    lowering test."""
    bf16 = torch.bfloat16
    clamped = ClampedSwiGLUExperts(32, 2880, 2880, LIMIT).to(bf16)
    swiglu = SwiGLUExperts(128, 2048, 768).to(bf16)
    for experts, top_k, hidden in ((clamped, 4, 2880), (swiglu, 8, 2048)):
        for tokens in (1, 4, 4096):
            g = torch.Generator().manual_seed(0)
            indices = torch.randint(0, experts.num_experts, (tokens, top_k), generator=g)
            x, weights = torch.empty(tokens, hidden, dtype=bf16), torch.empty(tokens, top_k)
            shared = torch.empty(tokens, hidden, dtype=bf16)  # a shared expert, gated or not
            gate = torch.empty(tokens, 1, dtype=bf16) if tokens == 4 else None
            layout = experts.fused_layout()
            fused_experts(x, weights.to(bf16), indices, **layout, add=shared, add_gate=gate)
            fused_experts(x, weights.to(bf16), indices, **layout)
            if experts is swiglu and tokens == 4:  # LoRA updates (fp32) inside both GEMMs
                lora = dict(
                    gate_up_add=torch.empty(tokens * top_k, 2 * 768),
                    down_add=lambda h, pairs: torch.empty(h.shape[0], 2048),
                )
                fused_experts(x, weights.to(bf16), indices, **layout, **lora)


def test_moe_launches_lower_for_hopper():
    """Triton's compiler accepts both expert kernels' launch variants, the combine's and the
    one-program alignment at gpt-oss-20b's and Qwen3-30B-A3B's sizes (which the interpreter
    alone would not prove)."""
    assert check_lowering(
        "layers.test_triton_moe:moe_launches",
        "heron.kernels.moe:_gate_up_kernel",
        "heron.kernels.moe:_down_kernel",
        "heron.kernels.moe:_combine_kernel",
        "heron.kernels.moe_align:_align_kernel",
    )
