"""The FP8 (E4M3) KV cache: the KV-write kernels store ``K / k_scale`` and ``V / v_scale``
rounded as ``heron.layers.fp8.to_fp8`` does, and the decode and extend kernels read it back
against dense fp32 attention over the dequantised keys and values (Triton's interpreter on the
CPU); the engine then runs with it (the cache spec, the plan, the reference operator)."""

from __future__ import annotations

import pytest
import torch
from ops.test_kv_write_kernel import make_rotary, reference
from ops.test_reference_attention import PagedHarness
from ops.test_triton_attention_kernels import (
    assert_close,
    decode_reference,
    dense_attention,
    make_paged_cache,
    strided_q,
    window_rows,
)
from triton_lowering import check_lowering

from heron import LLM, SamplingParams
from heron.kernels.attention_decode import paged_decode_attention
from heron.kernels.attention_extend import paged_extend_attention
from heron.kernels.kv_write import kv_write, qk_norm_rope_kv_write
from heron.layers.fp8 import FP8, to_fp8

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
K_SCALE, V_SCALE = 0.5, 2.0  # keys stored doubled, values halved: both scales matter
D = 64


def fp8_paged_cache(kv_lens, block_size, kv_heads):
    """``make_paged_cache``'s fp32 cache (NaN where unwritten) stored in FP8 with the scales,
    and the dequantised dense K and V per request."""
    cache, tables, ks, vs = make_paged_cache(
        kv_lens, block_size, kv_heads, D, torch.float32, DEVICE
    )
    fp8 = torch.stack([to_fp8(cache[0] / K_SCALE), to_fp8(cache[1] / V_SCALE)])
    ks = [to_fp8(k / K_SCALE).float() * K_SCALE for k in ks]
    vs = [to_fp8(v / V_SCALE).float() * V_SCALE for v in vs]
    return fp8, tables, ks, vs


def _on_the_grid(shape: tuple[int, ...], scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Random values that are E4M3 numbers times ``scale`` (some far past its range, to
    saturate): Triton's interpreter rounds fp32 to FP8 without carrying a rounded-up mantissa
    into the exponent (31.5 becomes 16), so exact checks off the GPU use values that need no
    rounding; ``test_kv_write_rounds_like_torch`` checks the rounding on a GPU."""
    values = to_fp8(torch.randn(shape) * 100).float() * scale
    values.view(-1)[::7] *= 4  # past 448 * scale
    return values.to(dtype).to(DEVICE)


def _check_kv_write(dtype: torch.dtype, k: torch.Tensor, v: torch.Tensor) -> None:
    kv_heads, bs = k.shape[1], 4
    cache = torch.zeros(2, 4, bs, kv_heads, D, dtype=FP8, device=DEVICE)
    slots = torch.tensor([1, 6, 7, 12, -1], dtype=torch.int32, device=DEVICE)
    kv_write(k, v, cache, slots, k_scale=K_SCALE, v_scale=V_SCALE)
    flat = cache.view(2, -1, kv_heads, D).float()
    kept = slots[:4].long()
    assert torch.equal(flat[0, kept], to_fp8(k[:4].float() / K_SCALE).float())
    assert torch.equal(flat[1, kept], to_fp8(v[:4].float() / V_SCALE).float())
    assert flat[0, kept].abs().max() == 448.0  # saturated, not NaN
    written = torch.zeros(flat.shape[1], dtype=torch.bool, device=DEVICE)
    written[kept] = True
    assert not flat[:, ~written].any()  # the padding token wrote nothing


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kv_write_stores_scaled_e4m3(dtype):
    shape = (5, 2, D)
    _check_kv_write(dtype, _on_the_grid(shape, K_SCALE, dtype), _on_the_grid(shape, V_SCALE, dtype))


@pytest.mark.gpu
def test_kv_write_rounds_like_torch():
    k = (torch.randn(5, 2, D, device=DEVICE) * 300).to(torch.bfloat16)
    _check_kv_write(torch.bfloat16, k, torch.randn(5, 2, D, device=DEVICE).to(torch.bfloat16))


def test_fused_rope_write_stores_scaled_e4m3():
    """At position 0 the rotation is the identity, so the keys reach the store unrounded."""
    tokens, heads, kv_heads = 3, 4, 2
    rotary = make_rotary(heads, kv_heads, D, 1.0).to(DEVICE)
    qkv = torch.cat(
        [
            torch.randn(tokens, heads * D, device=DEVICE),
            _on_the_grid((tokens, kv_heads * D), K_SCALE, torch.float32),
            _on_the_grid((tokens, kv_heads * D), V_SCALE, torch.float32),
        ],
        dim=1,
    )
    positions = torch.zeros(tokens, dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([2, 3, 9], dtype=torch.int32, device=DEVICE)
    want = torch.zeros(2, 3, 4, kv_heads, D, device=DEVICE)
    q_ref = reference(qkv, positions, rotary, None, want, slots, heads, kv_heads, D)
    cache = torch.zeros(2, 3, 4, kv_heads, D, dtype=FP8, device=DEVICE)
    q = qk_norm_rope_kv_write(
        qkv, positions, rotary.cos, rotary.sin, None, None, 0.0, cache, slots,
        heads, kv_heads, D, k_scale=K_SCALE, v_scale=V_SCALE,
    )  # fmt: skip
    torch.testing.assert_close(q, q_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(cache[0].float(), to_fp8(want[0] / K_SCALE).float())
    assert torch.equal(cache[1].float(), to_fp8(want[1] / V_SCALE).float())


@pytest.mark.parametrize(
    "dtype",
    # bf16 queries read an FP8 cache in fp16 (the interpreter's bf16 arithmetic is wrong)
    [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)],
)
@pytest.mark.parametrize("window,splits", [(None, 1), (None, 3), (20, 1), (20, 2)])
def test_decode_reads_the_fp8_cache(dtype, window, splits):
    kv_lens, heads, kv_heads, bs = [37, 5, 300], 4, 2, 16  # 300: tiles of 128 and a tail
    cache, tables, ks, vs = fp8_paged_cache(kv_lens, bs, kv_heads)
    tables, starts = window_rows(tables, kv_lens, [1] * len(kv_lens), window, bs)
    q = strided_q(len(kv_lens), heads, D, dtype, DEVICE, seed=1)
    out = torch.full_like(q, float("nan"))
    lens = torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE)
    paged_decode_attention(
        q, cache, tables, starts, lens, D**-0.5, window, out, splits,
        k_scale=K_SCALE, v_scale=V_SCALE,
    )  # fmt: skip
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3  # bf16 outputs: 8 bits of mantissa
    assert_close(out, decode_reference(q, ks, vs, window, D**-0.5), tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_extend_reads_the_fp8_cache(dtype):
    kv_lens, q_lens, heads, kv_heads, bs = [40, 9], [12, 9], 4, 2, 16
    cache, tables, ks, vs = fp8_paged_cache(kv_lens, bs, kv_heads)
    tables, table_starts = window_rows(tables, kv_lens, q_lens, None, bs)
    q = strided_q(sum(q_lens), heads, D, dtype, DEVICE, seed=2)
    out = torch.full_like(q, float("nan"))
    starts = torch.tensor([0, 12, 21], dtype=torch.int32, device=DEVICE)
    paged_extend_attention(
        q, cache, tables, table_starts, starts,
        torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE), max(q_lens), D**-0.5, None,
        out, k_scale=K_SCALE, v_scale=V_SCALE,
    )  # fmt: skip
    ref = torch.cat(
        [
            dense_attention(q[:12], ks[0], vs[0], None, D**-0.5),
            dense_attention(q[12:], ks[1], vs[1], None, D**-0.5),
        ]
    )
    assert_close(out, ref, 2e-3)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]
)
def test_uniform_steps_read_the_fp8_cache_on_the_decode_kernel(dtype):
    """A verification step's tokens as query rows of the decode kernel (three a request, each
    seeing the keys up to its own), split over the keys as the builder may split them."""
    kv_lens, q_len, heads, kv_heads, bs = [40, 300], 3, 4, 2, 16
    cache, tables, ks, vs = fp8_paged_cache(kv_lens, bs, kv_heads)
    tables, starts = window_rows(tables, kv_lens, [q_len] * len(kv_lens), None, bs)
    q = strided_q(len(kv_lens) * q_len, heads, D, dtype, DEVICE, seed=3)
    lens = torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    for splits in (1, 3):
        out = torch.full_like(q, float("nan"))
        paged_decode_attention(
            q, cache, tables, starts, lens, D**-0.5, None, out, splits,
            k_scale=K_SCALE, v_scale=V_SCALE, queries_per_row=q_len,
        )  # fmt: skip
        for r, (k, v) in enumerate(zip(ks, vs)):
            rows = slice(r * q_len, (r + 1) * q_len)
            assert_close(out[rows], dense_attention(q[rows], k, v, None, D**-0.5), tol)


class Fp8Harness(PagedHarness):
    """The reference operator's harness over an FP8 cache: keys and values on the grid of
    both scales (magnitudes from 0.25, so no scaled value is subnormal), so the dequantised
    history equals the harness's dense one and its checks apply as they are."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.cache = torch.zeros(self.cache.shape, dtype=FP8)
        self.op.bind_cache(self.cache)
        self.op.k_scale, self.op.v_scale = K_SCALE, V_SCALE

    def _rand(self, *shape: int) -> torch.Tensor:
        x = torch.randn(*shape, generator=self.gen)
        return to_fp8(x.sign() * (0.25 + x.abs())).float() * K_SCALE

    def check_cache(self, null_block_clean: bool = True) -> None:
        stored = self.cache
        self.cache = torch.stack([stored[0].float() * K_SCALE, stored[1].float() * V_SCALE])
        super().check_cache(null_block_clean)
        self.cache = stored


def test_reference_operator_over_an_fp8_cache():
    h = Fp8Harness(4, (4, 2), 5)
    h.step([("a", 9), ("b", 6)])
    h.step([("a", 1), ("b", 6), ("c", 11)])  # decode, extend, prefill
    h.step([("a", 1), ("b", 1), ("c", 1)])
    assert h.last_view.is_decode


def test_engine_halves_cache_bytes_with_fp8(tiny_model_dir):
    """The spec is FP8, so a block takes half of bf16's bytes (a quarter of fp32's) and a
    budget holds that many more blocks; the plan and the start-up log say so."""
    path = str(tiny_model_dir("qwen3"))
    specs = {}
    for kv in ("auto", "fp8"):
        llm = LLM(path, dtype="bfloat16", max_model_len=128, max_num_seqs=4, kv_cache_dtype=kv)
        (blocks,) = llm.engine.runner.cache.split_budget(1 << 20, 128, 128)
        specs[kv] = (llm.engine.kv_cache.group_usage()[0].spec, blocks)
    (bf16, blocks_bf16), (fp8, blocks_fp8) = specs["auto"], specs["fp8"]
    assert bf16.dtype == torch.bfloat16 and fp8.dtype == FP8
    assert fp8.bytes_per_block * 2 == bf16.bytes_per_block
    assert blocks_fp8 - 1 >= 2 * (blocks_bf16 - 1)
    assert "float8_e4m3fn" in fp8.describe()


def test_invalid_kv_cache_dtype_is_named(tiny_model_dir):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, got 'int8'"):
        LLM(str(tiny_model_dir("llama")), kv_cache_dtype="int8")


def fp8_cache_launches() -> None:
    """bf16 launches over an FP8 cache at Qwen3-0.6B's layer shape: the KV writes, decode
    with one and several splits, extend."""
    bf16, heads, kv_heads = torch.bfloat16, 16, 8
    cache = torch.empty(2, 8, 16, kv_heads, 128, dtype=FP8)
    slots = torch.zeros(2, dtype=torch.int32)
    k = torch.empty(2, kv_heads, 128, dtype=bf16)
    kv_write(k, k, cache, slots, k_scale=K_SCALE, v_scale=V_SCALE)
    rotary = make_rotary(heads, kv_heads, 128, 1.0)
    qkv = torch.empty(2, (heads + 2 * kv_heads) * 128, dtype=bf16)
    qk_norm_rope_kv_write(
        qkv, slots, rotary.cos, rotary.sin, None, None, 0.0, cache, slots,
        heads, kv_heads, 128, k_scale=K_SCALE, v_scale=V_SCALE,
    )  # fmt: skip
    tables, starts = torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    lens, q = torch.ones(2, dtype=torch.int32), torch.empty(2, heads, 128, dtype=bf16)
    for splits in (1, 4):
        paged_decode_attention(
            q, cache, tables, starts, lens, 0.1, None, torch.empty_like(q), splits,
            k_scale=K_SCALE, v_scale=V_SCALE,
        )  # fmt: skip
    query_start = torch.tensor([0, 1, 2], dtype=torch.int32)
    paged_extend_attention(
        q, cache, tables, starts, query_start, lens, 1, 0.1, None, torch.empty_like(q),
        k_scale=K_SCALE, v_scale=V_SCALE,
    )  # fmt: skip


def test_fp8_cache_launches_lower_for_hopper():
    """Triton's compiler accepts every kernel over an FP8 cache (the interpreter alone would
    not prove it)."""
    assert check_lowering(
        "ops.test_fp8_kv_cache:fp8_cache_launches",
        "heron.kernels.kv_write:_kv_write_kernel",
        "heron.kernels.kv_write:_qk_norm_rope_kv_write_kernel",
        "heron.kernels.attention_decode:_decode_kernel",
        "heron.kernels.attention_extend:_extend_kernel",
    )


@pytest.mark.gpu
def test_cuda_graph_replays_equal_eager_steps_with_fp8(tiny_model_dir):
    """FP8 weights and the FP8 cache on the Triton kernels: graph replays (the GEMV for few
    rows, FP8 tensor cores for 24) give the eager steps' tokens. The first token comes from
    the same eager prefill; later ones may split attention differently (graphs size splits
    for max_model_len), so bf16 near-ties may flip a few."""
    path = str(tiny_model_dir("qwen3"))
    prompts = [[5 + i, 6, 7, 8 + i] * 5 for i in range(24)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for eager in (True, False):
        llm = LLM(
            path,
            device="cuda",
            dtype="bfloat16",
            max_model_len=128,
            num_kv_blocks=64,
            quantization="fp8",
            kv_cache_dtype="fp8",
            enforce_eager=eager,
            cuda_graph_max_bs=32,
        )
        assert (llm.engine.runner.graphs is None) == eager
        for batch in (prompts[:3], prompts):
            outs = llm.generate(batch, params, use_tqdm=False)
            tokens[eager, len(batch)] = [o.outputs[0].token_ids for o in outs]
    for n in (3, 24):
        graph, eager = tokens[False, n], tokens[True, n]
        assert [t[0] for t in graph] == [t[0] for t in eager]
        same = sum(a == b for g, e in zip(graph, eager) for a, b in zip(g, e))
        assert same >= 0.9 * n * params.max_tokens, (graph, eager)
