"""The Triton MLA decode kernel, with weight absorption around it, against dense fp32
attention over decompressed keys and values (no absorption), on shuffled, NaN-filled latent
caches; one and several splits, requests planned to fewer splits than the launch has, padded
rows. Small cases run under the interpreter; ``gpu`` cases use DeepSeek's shapes in bf16, and
the builder's pre-capture hook is shown to be what keeps a replayed graph's plan fresh."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from ops.mla_cases import DEVICE, dense_reference, latent_cache
from triton_lowering import check_lowering

import heron.kernels.mla_decode as mla
from heron.cache.paged_parts import paged_layout
from heron.kernels.mla_decode import MLADecodePlan, mla_decode_attention, plan_mla_decode
from heron.kernels.mla_rope import mla_rope_latent_write
from heron.metadata import ModelBuildContext, SequenceMetadata, StepBatch
from heron.ops.mla.base import MLASpec
from heron.ops.mla.triton import TritonMLA, TritonMLABuilder

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")


def run_case(kv_lens, heads, lora, rope, nope, v_dim, max_splits, dtype, block_size=16):
    gen = torch.Generator().manual_seed(1)
    cache, tables, dense = latent_cache(kv_lens, block_size, lora + rope, dtype)
    batch = len(kv_lens)
    w_uk = torch.randn(heads, nope, lora, generator=gen) / lora**0.5
    w_uv = torch.randn(heads, v_dim, lora, generator=gen) / lora**0.5
    q_nope = torch.randn(batch, heads, nope, generator=gen)
    q_rope = torch.randn(batch, heads, rope, generator=gen)
    scale = (nope + rope) ** -0.5
    want = dense_reference(q_nope, q_rope, dense, [1] * batch, w_uk, w_uv, scale)
    # Absorbed: the query in latent space, the kernel over the cache, W_UV after.
    q = torch.cat([torch.einsum("rhn,hnl->rhl", q_nope, w_uk), q_rope], -1)
    lens = torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE)
    plan = MLADecodePlan(torch.empty_like(lens), torch.empty_like(lens))
    plan_mla_decode(lens, max_splits, plan)
    out = torch.empty(batch, heads, lora, dtype=dtype, device=DEVICE)
    partial_out = torch.empty(batch, heads, max_splits, lora, device=DEVICE)
    partial_lse = torch.empty(batch, heads, max_splits, device=DEVICE)
    mla_decode_attention(
        q.to(dtype).to(DEVICE), cache, tables, lens, scale, lora, plan, max_splits, out,
        partial_out, partial_lse,
    )  # fmt: skip
    got = torch.einsum("rhl,hvl->rhv", out.float().cpu(), w_uv)
    return got, want, plan


@pytest.mark.parametrize(("max_splits", "min_keys"), [(1, 20), (3, 20), (20, 4)])
def test_decode_equals_dense_attention(monkeypatch, max_splits, min_keys):
    # The 70-key request plans 1, 3 or 18 splits (the merge then takes two chunks), the others
    # fewer; the last row is padded.
    monkeypatch.setattr(mla, "LAUNCH", replace(mla.LAUNCH, min_keys_per_split=min_keys))
    kv_lens = [70, 1, 33, 0]
    got, want, plan = run_case(kv_lens, heads=5, lora=32, rope=8, nope=16, v_dim=12,
                               max_splits=max_splits, dtype=torch.float32)  # fmt: skip
    splits = [min(max_splits, max(1, -(-n // min_keys))) for n in kv_lens]
    assert plan.num_splits.tolist() == splits
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_plan_splits_by_length_within_the_launch():
    lens = torch.tensor([0, 1, 256, 257, 5000], dtype=torch.int32)
    plan = MLADecodePlan(torch.empty(6, dtype=torch.int32), torch.empty(6, dtype=torch.int32))
    plan_mla_decode(lens, 8, plan)  # a plan over the first rows of bigger buffers
    assert plan.num_splits[:5].tolist() == [1, 1, 4, 5, 8]
    assert plan.split_len[:5].tolist() == [0, 32, 64, 64, 640]  # whole tiles, covering all


def mla_launches() -> None:
    """bf16 launches at DeepSeek's latent shape: the decode (V3's 128 heads; every head count
    compiles to the same 16-head programs) with one split and several, and of two query tokens
    per request, the fused RoPE + latent write (interleaved, 128 heads)."""
    bf16 = torch.bfloat16
    cache = torch.empty(8, 64, 576, dtype=bf16)
    tables = torch.zeros(2, 4, dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    plan = MLADecodePlan(lens.clone(), lens.clone())
    q = torch.empty(2, 128, 576, dtype=bf16)
    out = torch.empty(2, 128, 512, dtype=bf16)
    for splits in (1, 8):
        partial_out = torch.empty(2, 128, splits, 512)
        partial_lse = torch.empty(2, 128, splits)
        mla_decode_attention(
            q, cache, tables, lens, 0.1, 512, plan, splits, out, partial_out, partial_lse
        )
    # a verification step: both query rows are one request's tokens
    mla_decode_attention(
        q, cache, tables[:1], lens[:1], 0.1, 512, plan, 8, out, partial_out, partial_lse, 2
    )
    table = torch.empty(64, 32)
    slots = torch.zeros(2, dtype=torch.int32)
    q_full = torch.empty(2, 128, 192, dtype=bf16)
    latent, k_rope = torch.empty(2, 512, dtype=bf16), torch.empty(2, 64, dtype=bf16)
    mla_rope_latent_write(q_full, latent, k_rope, lens, slots, table, table, cache, 128, True)


def test_mla_launches_lower_for_hopper():
    assert check_lowering(
        "ops.test_mla_decode_kernel:mla_launches",
        "heron.kernels.mla_decode:_mla_split_kernel",
        "heron.kernels.mla_decode:_mla_merge_kernel",
        "heron.kernels.mla_rope:_mla_rope_write_kernel",
    )


@pytest.mark.gpu
@pytest.mark.parametrize("kv_lens", [[1, 700, 4096, 0, 37], [4000] * 3])
def test_decode_bf16_deepseek_shape(kv_lens):
    got, want, _ = run_case(kv_lens, heads=16, lora=512, rope=64, nope=128, v_dim=128,
                            max_splits=8, dtype=torch.bfloat16, block_size=64)  # fmt: skip
    torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)


def decode_step(kv_lens, block_size, tables):
    n = len(kv_lens)
    step = StepBatch(n, n, n, block_size, [paged_layout(n, n, tables.shape[1])])
    step.query_lens[:] = 1
    step.kv_lens[:] = kv_lens
    step.group_parts[0]["block_tables"][:] = tables.cpu().numpy()
    step.finish()
    return SequenceMetadata.from_step_batch(step, DEVICE)


def test_graph_buffers_plan_once_until_before_capture(monkeypatch):
    """On graph buffers the first call plans and later calls reuse the plan, even after new
    lengths are filled in (what a replay of a graph captured without the hook would do);
    ``before_capture`` makes the next call plan again, from the lengths now in the buffers."""
    monkeypatch.setattr(mla, "LAUNCH", replace(mla.LAUNCH, min_keys_per_split=16))
    block_size, kv_lens = 16, [40, 70, 3, 50]
    op = TritonMLA("l0", MLASpec(4, 32, 16, 16, 16, 0.1), block_size, 256, None, None,
                   ModelBuildContext())  # fmt: skip
    builder = op.metadata_builder()
    op.kv_cache, tables, _ = latent_cache(kv_lens, block_size, 48, torch.float32)
    tables = torch.cat([tables, tables.new_zeros(4, 16 - tables.shape[1])], 1)
    q = torch.randn(4, 4, 48, device=DEVICE)
    eager = op.attend_latent(q, builder.build(decode_step(kv_lens, block_size, tables)))
    buffers = builder.make_graph_buffers(4, DEVICE)
    dummy = decode_step([1] * 4, block_size, torch.zeros_like(tables))
    builder.fill(dummy, buffers, 4)
    view = builder.graph_view(dummy, buffers, 4)
    op.attend_latent(q, view)
    assert buffers.plan.ready and buffers.plan.split_len.tolist() == [32] * 4
    builder.fill(decode_step(kv_lens, block_size, tables), buffers, 4)
    assert not torch.equal(op.attend_latent(q, view), eager)  # the dummy step's plan
    builder.before_capture(buffers)
    torch.testing.assert_close(op.attend_latent(q, view), eager)


@pytest.mark.gpu
@pytest.mark.parametrize("hook", [True, False])
def test_replayed_graph_plans_only_with_the_pre_capture_hook(monkeypatch, hook):
    """The operator's decode captured on a dummy step (every length 1) and replayed on long
    contexts: with ``before_capture`` the replay recomputes the plan and equals eager; without
    it the warm-up's plan (one 32-key split) is replayed and the output is wrong."""
    monkeypatch.setattr(mla, "LAUNCH", replace(mla.LAUNCH, min_keys_per_split=64))
    if not hook:
        monkeypatch.setattr(TritonMLABuilder, "before_capture", lambda self, buffers: None)
    spec = MLASpec(16, 512, 128, 64, 128, 0.1)
    block_size, kv_lens = 64, [900, 2000, 300, 1500]
    op = TritonMLA("l0", spec, block_size, 4096, None, None, ModelBuildContext())
    builder = op.metadata_builder()
    op.kv_cache, tables, _ = latent_cache(kv_lens, block_size, 576, torch.bfloat16)
    tables = torch.cat([tables, tables.new_zeros(4, 64 - tables.shape[1])], 1)
    q = torch.randn(4, 16, 576, dtype=torch.bfloat16, device=DEVICE)

    eager = op.attend_latent(q, builder.build(decode_step(kv_lens, block_size, tables)))
    buffers = builder.make_graph_buffers(4, DEVICE)
    dummy = decode_step([1] * 4, block_size, torch.zeros_like(tables))
    builder.fill(dummy, buffers, 4)
    view = builder.graph_view(dummy, buffers, 4)
    assert view.workspace.max_splits > 1
    op.attend_latent(q, view)  # warm-up: plans for the dummy lengths
    builder.before_capture(buffers)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = op.attend_latent(q, view)
    builder.fill(decode_step(kv_lens, block_size, tables), buffers, 4)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager) == hook
