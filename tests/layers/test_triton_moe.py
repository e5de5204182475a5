"""The fused Triton MoE (heron.kernels.moe) against the experts' sparse reference: tiny
shapes under the Triton interpreter on the CPU; on a GPU, gpt-oss-20b's shapes (bf16, and fp32)
against an fp64 reference and CUDA-graph replays with changing routing."""

from __future__ import annotations

import pytest
import torch
from triton_lowering import check_lowering

from heron.kernels.moe import align_by_expert, fused_experts
from heron.layers.moe import ClampedSwiGLUExperts, MoEMLP
from heron.ops.selector import layer_kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LIMIT = 7.0


def make_experts(num_experts, hidden, inter, dtype, device=DEVICE, seed=0, kernels="torch"):
    """Random experts whose gate_up outputs reach well past the clamp for unit-scale inputs."""
    g = torch.Generator(device).manual_seed(seed)
    with torch.device(device):
        experts = ClampedSwiGLUExperts(
            num_experts, hidden, inter, LIMIT, kernels=layer_kernels(kernels)
        )
    with torch.no_grad():
        for name, p in experts.named_parameters():
            std = {"gate_up_proj": 3.5 / hidden**0.5, "down_proj": 1.0 / inter**0.5}
            p.normal_(0.0, std.get(name, 0.5), generator=g)
    return experts.to(dtype)


def converted(experts, dtype):
    """A copy of ``experts`` in ``dtype`` (the same values, rounded or widened)."""
    num_experts, inter, hidden = experts.down_proj.shape
    with torch.device(experts.down_proj.device):
        copy = ClampedSwiGLUExperts(num_experts, hidden, inter, experts.limit).to(dtype)
    copy.load_state_dict(experts.state_dict())
    return copy


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
    return fused_experts(
        x,
        weights,
        indices,
        experts.gate_up_proj,
        experts.gate_up_proj_bias,
        experts.down_proj,
        experts.down_proj_bias,
        experts.alpha,
        experts.limit,
        blocks,
    )


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.abs().max()).item()


def clamps_bite(experts, x) -> bool:
    gate_up = torch.einsum("th,ehi->eti", x.double(), experts.gate_up_proj.double())
    return gate_up.abs().max().item() > 2 * experts.limit


def test_align_by_expert():
    """Each used block holds one expert's pairs in token order, padding rows the sentinel."""
    num_experts, block_m = 5, 16
    indices = torch.tensor([[3, 0]] * 20 + [[0, 2]] * 3 + [[2, 3]])  # expert 1 and 4 get none
    sorted_ids, block_expert, num_blocks = align_by_expert(indices, num_experts, block_m)
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
def test_matches_sparse_reference(num_tokens, kind, hidden, inter, blocks):
    experts = make_experts(4, hidden, inter, torch.float32)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(num_tokens))
    x = 2 * x.to(DEVICE)
    weights, indices = route(num_tokens, 4, 2, kind, seed=num_tokens)
    assert clamps_bite(experts, x)
    want = experts.forward_sparse(x, weights, indices)
    got = run_fused(experts, x, weights, indices, blocks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("num_tokens", [5, 40])
def test_one_expert_gets_every_token(num_tokens):
    """k = 1 and every token on one expert: that expert's rows span several blocks."""
    experts = make_experts(4, 32, 16, torch.float32)
    x = 2 * torch.randn(num_tokens, 32, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    weights, indices = route(num_tokens, 4, 1, "one")
    assert (indices == 3).all()
    want = experts.forward_sparse(x, weights, indices)
    got = run_fused(experts, x, weights, indices, (16, 16, 16))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_fp16_strided_input():
    experts = make_experts(4, 32, 16, torch.float16)
    x = torch.randn(13, 64, generator=torch.Generator().manual_seed(2)).half().to(DEVICE)
    x = x[:, 16:48]  # rows 64 apart
    weights, indices = route(13, 4, 2, "random")
    weights = weights.half()
    assert x.stride(0) == 64
    want = converted(experts, torch.float32).forward_sparse(x.float(), weights.float(), indices)
    got = run_fused(experts, x, weights, indices)
    assert got.dtype == torch.float16
    assert rel_err(got, want) < 5e-3


def test_no_tokens():
    experts = make_experts(4, 32, 16, torch.float32)
    weights, indices = route(0, 4, 2, "random")
    out = run_fused(experts, torch.zeros(0, 32, device=DEVICE), weights, indices)
    assert out.shape == (0, 32)


# gpt-oss-20b's experts: 32 of them, top-4, hidden 2880, intermediate 2880.
E20, K20, H20, I20 = 32, 4, 2880, 2880


@pytest.fixture(scope="module")
def experts_20b():
    """bf16 and fp32 experts of gpt-oss-20b's shapes, each with an fp64 copy (the reference)."""
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        experts = make_experts(E20, H20, I20, dtype, device="cuda", kernels="triton")
        out[dtype] = experts, converted(experts, torch.float64)
    return out


def reference(ref, x, weights, indices):
    """The sparse reference in fp64 on the same (rounded) weights and inputs."""
    return ref.forward_sparse(x.double(), weights.double(), indices)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 300])
@pytest.mark.parametrize("kind", ["random", "skewed"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_gpt_oss_20b_shapes(experts_20b, num_tokens, kind, dtype):
    experts, ref = experts_20b[dtype]
    g = torch.Generator("cuda").manual_seed(num_tokens)
    x = torch.randn(num_tokens, H20, generator=g, device="cuda").to(dtype)
    weights, indices = route(num_tokens, E20, K20, kind, device="cuda", seed=num_tokens)
    weights = weights.to(dtype)
    assert clamps_bite(experts, x)
    got = experts(x, weights, indices)  # the module built with the Triton kernels
    assert got.dtype == dtype
    assert rel_err(got, reference(ref, x, weights, indices)) < (
        1e-2 if dtype == torch.bfloat16 else 1e-4
    )


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 300])
def test_gpu_cuda_graph_replay_with_new_routing(experts_20b, num_tokens):
    """The experts captured once replay right for other inputs and other routings."""
    experts, ref = experts_20b[torch.bfloat16]
    x = torch.zeros(num_tokens, H20, dtype=torch.bfloat16, device="cuda")
    weights, indices = route(num_tokens, E20, K20, "random", device="cuda")
    weights = weights.to(torch.bfloat16)
    experts(x, weights, indices)  # eager warm-up compiles the kernels
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = experts(x, weights, indices)
    for seed, kind in [(1, "random"), (2, "skewed"), (3, "random")]:
        g = torch.Generator("cuda").manual_seed(seed)
        x.copy_(torch.randn(num_tokens, H20, generator=g, device="cuda"))
        new_weights, new_indices = route(num_tokens, E20, K20, kind, device="cuda", seed=seed)
        weights.copy_(new_weights)
        indices.copy_(new_indices)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, experts(x, weights, indices))
        assert rel_err(out, reference(ref, x, weights, indices)) < 1e-2


@pytest.mark.gpu
def test_gpu_cuda_graph_moe_block():
    """The whole block (router, top-k, softmax, experts) captured: a new ``x`` routes anew."""
    torch.manual_seed(0)
    moe = MoEMLP(H20, I20, E20, K20, LIMIT, layer_kernels("triton")).cuda()
    with torch.no_grad():
        for name, p in moe.named_parameters():
            p.normal_(0.0, 0.5 if name.endswith("bias") else 3.5 / H20**0.5)
    moe = moe.to(torch.bfloat16)
    x = torch.randn(8, H20, dtype=torch.bfloat16, device="cuda")
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
        routings.append(moe.router(x).topk(K20, dim=-1).indices)
    assert not torch.equal(routings[0], routings[1])


def moe_launches() -> None:
    """bf16 launches at gpt-oss-20b's expert sizes (hidden and intermediate 2880, top-4), for a
    decode-sized and a prefill-sized batch (different row blocks), for the lowering test."""
    bf16, experts = torch.bfloat16, 32
    gate_up = torch.empty(experts, 2880, 2 * 2880, dtype=bf16)
    down = torch.empty(experts, 2880, 2880, dtype=bf16)
    for tokens in (4, 4096):
        indices = torch.randint(0, experts, (tokens, 4), generator=torch.Generator().manual_seed(0))
        fused_experts(
            torch.empty(tokens, 2880, dtype=bf16), torch.empty(tokens, 4, dtype=bf16), indices,
            gate_up, torch.empty(experts, 2 * 2880, dtype=bf16), down,
            torch.empty(experts, 2880, dtype=bf16), 1.702, LIMIT,
        )  # fmt: skip


def test_moe_launches_lower_for_hopper():
    """Triton's compiler accepts both expert kernels' launch variants at gpt-oss-20b's sizes
    (which the interpreter alone would not prove)."""
    assert check_lowering(
        "layers.test_triton_moe:moe_launches",
        "heron.kernels.moe:_gate_up_kernel",
        "heron.kernels.moe:_down_kernel",
    )
