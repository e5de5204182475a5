"""The fused qk-norm + rotary + KV-cache-write kernel against the PyTorch modules it replaces.

The reference is the model's own path: ``RMSNorm`` (or Gemma 3's ``GemmaRMSNorm``) per head,
``RotaryEmbedding`` and the reference backend's scatter into the paged cache. Small cases run
on the GPU when there is one, else under the Triton interpreter (fp32/fp16); ``gpu`` cases
check bf16 at model shapes and CUDA-graph replay.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import transformers as tf
from triton_lowering import check_lowering

from heron.kernels.kv_write import kv_write, qk_norm_rope_kv_write
from heron.layers.norm import GemmaRMSNorm, RMSNorm
from heron.layers.rotary import RotaryEmbedding

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MAX_POS = 64


def make_rotary(heads: int, kv_heads: int, head_dim: int, partial: float) -> RotaryEmbedding:
    config = tf.Qwen3Config(
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": partial,
        },
    )
    return RotaryEmbedding(config, head_dim, MAX_POS)


def make_norms(
    head_dim: int, dtype: torch.dtype, device: str, norm_cls: type = RMSNorm
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """q and k norms with random weights scaling by 0.5 to 1.5 (Gemma's are zero-centred)."""
    norms = norm_cls(head_dim), norm_cls(head_dim)
    for norm in norms:
        weight = torch.rand(head_dim) + 0.5 - norm_cls.weight_offset
        norm.weight.data = weight.to(dtype=dtype, device=device)
    return norms


def reference(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    rotary: RotaryEmbedding,
    norms: tuple[RMSNorm, RMSNorm] | None,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    heads: int,
    kv_heads: int,
    head_dim: int,
) -> torch.Tensor:
    """The model's attention pre-processing; writes ``kv_cache`` and returns q."""
    tokens = qkv.shape[0]
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q = q.reshape(tokens, heads, head_dim)
    k = k.reshape(tokens, kv_heads, head_dim)
    v = v.reshape(tokens, kv_heads, head_dim)
    if norms is not None:
        q, k = norms[0](q), norms[1](k)
    q, k = rotary(positions, q, k)
    kv_cache[0].view(-1, kv_heads, head_dim)[slots[:tokens].long()] = k
    kv_cache[1].view(-1, kv_heads, head_dim)[slots[:tokens].long()] = v
    return q


def run_case(
    tokens: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    qk_norm: bool,
    partial: float,
    num_blocks: int,
    block_size: int,
    device: str,
    norm_cls: type = RMSNorm,
) -> None:
    """Random qkv, positions and shuffled slots; q and the cache must match the reference."""
    rotary = make_rotary(heads, kv_heads, head_dim, partial).to(device)
    norms = make_norms(head_dim, dtype, device, norm_cls) if qk_norm else None
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=device)
    positions = torch.randint(0, MAX_POS, (tokens,), device=device)
    # Spare entries past the tokens check that only slot_mapping[:T] is read.
    slots = torch.randperm(num_blocks * block_size, device=device)[: tokens + 2].to(torch.int32)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)
    original = cache.clone()
    expected_cache = cache.clone()
    expected_q = reference(
        qkv, positions, rotary, norms, expected_cache, slots, heads, kv_heads, head_dim
    )
    eps = norms[0].eps if norms else 0.0
    q = qk_norm_rope_kv_write(
        qkv,
        positions.to(torch.int32),
        rotary.cos,
        rotary.sin,
        norms[0].weight if norms else None,
        norms[1].weight if norms else None,
        eps,
        cache,
        slots,
        heads,
        kv_heads,
        head_dim,
        norm_weight_offset=norm_cls.weight_offset,
        norm_scale_in_fp32=norm_cls.scale_in_fp32,
    )
    assert_close(q, expected_q)
    assert_close(cache, expected_cache)
    # Exactly the slots of the T tokens changed (in both K and V); the rest is untouched.
    changed = (cache != original).view(2, num_blocks * block_size, -1).any(-1)
    written = torch.zeros_like(changed)
    written[:, slots[:tokens].long()] = True
    assert torch.equal(changed, written)


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32: within an ulp or so (the qk-norm's sum order); else within one ulp of the dtype."""
    assert actual.dtype == expected.dtype
    ulp = torch.finfo(expected.dtype).eps
    tol = 2e-6 if expected.dtype == torch.float32 else ulp
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_qk_norm_rope_kv_write(dtype: torch.dtype, qk_norm: bool, partial: float) -> None:
    torch.manual_seed(0)
    run_case(6, 4, 2, 32, dtype, qk_norm, partial, 4, 4, DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_gemma_qk_norm_rope_kv_write(dtype: torch.dtype, partial: float) -> None:
    """Gemma 3's qk-norm: (1 + w) * norm(x), scaled in fp32 and rounded once."""
    torch.manual_seed(5)
    run_case(6, 4, 2, 32, dtype, True, partial, 4, 4, DEVICE, GemmaRMSNorm)


def test_gemma_norm_is_hf_gemma3_and_differs_from_llama() -> None:
    """The reference above is HF's Gemma3RMSNorm, and not Llama's form (the test is not vacuous)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    torch.manual_seed(6)
    ours, theirs = GemmaRMSNorm(32), Gemma3RMSNorm(32)
    theirs.weight.data.uniform_(-0.5, 0.5)
    ours.weight.data.copy_(theirs.weight.data)
    x = torch.randn(6, 4, 32).to(torch.float16)
    ours, theirs = ours.half(), theirs.half()
    assert torch.equal(ours(x), theirs(x))
    llama = RMSNorm(32).half()
    llama.weight.data.copy_(ours.weight.data)
    assert not torch.allclose(ours(x).float(), llama(x).float(), atol=0.1)


@pytest.mark.parametrize("scale_in_fp32", [True, False])
def test_gemma_qk_norm_rounds_once_fp16(scale_in_fp32: bool) -> None:
    """In fp16 the kernel matches GemmaRMSNorm bit for bit but for rare sum-order flips, and
    only with Gemma's single rounding: Llama's round-then-scale differs in about a quarter of
    q's values (the 1-ulp tolerance above cannot tell the two apart)."""
    torch.manual_seed(8)
    tokens, heads, kv_heads, head_dim = 64, 4, 2, 32
    rotary = make_rotary(heads, kv_heads, head_dim, 1.0).to(DEVICE)
    norms = make_norms(head_dim, torch.float16, DEVICE, GemmaRMSNorm)
    qkv = 3 * torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=DEVICE)
    qkv = qkv.to(torch.float16)
    positions = torch.randint(0, MAX_POS, (tokens,), device=DEVICE)
    slots = torch.randperm(64 * 4, device=DEVICE)[:tokens].to(torch.int32)
    cache = torch.zeros(2, 64, 4, kv_heads, head_dim, dtype=torch.float16, device=DEVICE)
    expected_cache = cache.clone()
    expected_q = reference(
        qkv, positions, rotary, norms, expected_cache, slots, heads, kv_heads, head_dim
    )
    q = qk_norm_rope_kv_write(
        qkv, positions, rotary.cos, rotary.sin, norms[0].weight, norms[1].weight, norms[0].eps,
        cache, slots, heads, kv_heads, head_dim,
        norm_weight_offset=1.0, norm_scale_in_fp32=scale_in_fp32,
    )  # fmt: skip
    mismatched = (q != expected_q).float().mean().item()
    if scale_in_fp32:
        assert mismatched < 0.01
        assert (cache != expected_cache).float().mean().item() < 0.01
    else:
        assert mismatched > 0.1


def test_qk_norm_rope_kv_write_exact_without_norm() -> None:
    """Without the norm there is no reduction: fp32 results match the reference bit for bit."""
    torch.manual_seed(1)
    rotary = make_rotary(2, 1, 16, 1.0).to(DEVICE)
    qkv = torch.randn(3, 4 * 16, device=DEVICE)
    positions = torch.tensor([5, 0, 63], device=DEVICE)
    slots = torch.tensor([7, 2, 4], dtype=torch.int32, device=DEVICE)
    cache = torch.zeros(2, 2, 4, 1, 16, device=DEVICE)
    expected_cache = cache.clone()
    expected_q = reference(qkv, positions, rotary, None, expected_cache, slots, 2, 1, 16)
    args = (None, None, 0.0, cache, slots, 2, 1, 16)
    q = qk_norm_rope_kv_write(qkv, positions, rotary.cos, rotary.sin, *args)
    assert torch.equal(q, expected_q)
    assert torch.equal(cache, expected_cache)


def test_kv_write() -> None:
    torch.manual_seed(2)
    k, v = torch.randn(2, 5, 3, 8, device=DEVICE).unbind(0)
    slots = torch.tensor([9, 0, 4, 11, 6], dtype=torch.int32, device=DEVICE)
    cache = torch.zeros(2, 3, 4, 3, 8, device=DEVICE)
    kv_write(k, v, cache, slots)
    assert torch.equal(cache[0].view(-1, 3, 8)[slots.long()], k)
    assert torch.equal(cache[1].view(-1, 3, 8)[slots.long()], v)
    assert cache.view(2, -1, 24).abs().sum(-1).count_nonzero() == 2 * 5


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 2048])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_qk_norm_rope_kv_write_bf16(tokens: int, qk_norm: bool) -> None:
    torch.manual_seed(3)
    run_case(tokens, 16, 8, 128, torch.bfloat16, qk_norm, 1.0, 256, 16, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 2048])
def test_gemma_qk_norm_rope_kv_write_bf16(tokens: int) -> None:
    """Gemma 3 1B's attention: 4 heads, 1 KV head of 256; bf16 rounds once after the scale."""
    torch.manual_seed(7)
    run_case(tokens, 4, 1, 256, torch.bfloat16, True, 1.0, 256, 16, "cuda", GemmaRMSNorm)


@pytest.mark.gpu
def test_qk_norm_rope_kv_write_cuda_graph() -> None:
    """Captured once, replayed with new positions and slots written into the same buffers."""
    torch.manual_seed(4)
    tokens, heads, kv_heads, head_dim = 8, 16, 8, 128
    rotary = make_rotary(heads, kv_heads, head_dim, 1.0).cuda()
    norms = make_norms(head_dim, torch.bfloat16, "cuda")
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=torch.bfloat16).cuda()
    positions = torch.zeros(tokens, dtype=torch.int64, device="cuda")
    slots = torch.zeros(tokens, dtype=torch.int32, device="cuda")
    cache = torch.zeros(2, 16, 16, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    q_out = torch.empty(tokens, heads, head_dim, dtype=torch.bfloat16, device="cuda")
    args = (rotary.cos, rotary.sin, norms[0].weight, norms[1].weight, norms[0].eps, cache)

    def step() -> None:
        qk_norm_rope_kv_write(qkv, positions, *args, slots, heads, kv_heads, head_dim, q_out)

    step()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(2):
        positions.copy_(torch.randint(0, MAX_POS, (tokens,)))
        slots.copy_(torch.randperm(16 * 16)[:tokens].to(torch.int32))
        qkv.copy_(torch.randn_like(qkv))
        expected_cache = cache.clone()
        expected_q = reference(
            qkv, positions, rotary, norms, expected_cache, slots, heads, kv_heads, head_dim
        )
        graph.replay()
        torch.cuda.synchronize()
        assert_close(q_out, expected_q)
        assert_close(cache, expected_cache)


def kv_write_launches() -> None:
    """bf16 launches at real layer shapes (Gemma-3-1B, Qwen3-0.6B, gpt-oss-like): the plain KV
    write, and the fused pre-write without a qk-norm, with Qwen3's and with Gemma 3's, over a
    full and a partial rotary dimension, each also starting the next kernel early as on a
    decode step (for the lowering test)."""
    bf16 = torch.bfloat16
    forms = [(None, 0.0, False), (RMSNorm, 0.0, False), (GemmaRMSNorm, 1.0, True)]
    for heads, kv_heads, head_dim in [(4, 1, 256), (16, 8, 128), (64, 8, 64)]:
        cache = torch.empty(2, 8, 16, kv_heads, head_dim, dtype=bf16)
        slots = torch.zeros(3, dtype=torch.int32)
        k = torch.empty(3, kv_heads, head_dim, dtype=bf16)
        qkv = torch.empty(3, (heads + 2 * kv_heads) * head_dim, dtype=bf16)
        for start_next in (False, True):
            kv_write(k, torch.empty_like(k), cache, slots, start_next=start_next)
        for (norm, offset, in_fp32), rotary, start_next in itertools.product(
            forms, (head_dim, head_dim // 4), (False, True)
        ):
            cos = torch.empty(MAX_POS, rotary // 2, dtype=torch.float32)
            weight = torch.empty(head_dim, dtype=bf16) if norm else None
            qk_norm_rope_kv_write(
                qkv, torch.zeros(3, dtype=torch.int32), cos, torch.empty_like(cos), weight,
                weight, 1e-6, cache, slots, heads, kv_heads, head_dim,
                norm_weight_offset=offset, norm_scale_in_fp32=in_fp32, start_next=start_next,
            )  # fmt: skip


def test_kv_write_launches_lower_for_hopper() -> None:
    """Triton's compiler accepts both kernels' launch variants at real layer shapes (which
    the interpreter alone would not prove)."""
    assert check_lowering(
        "ops.test_kv_write_kernel:kv_write_launches",
        "heron.kernels.kv_write:_kv_write_kernel",
        "heron.kernels.kv_write:_qk_norm_rope_kv_write_kernel",
    )
