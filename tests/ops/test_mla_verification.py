"""Uniform verification steps (``q`` tokens per row: the last token and its proposals) through
the Triton MLA decode kernel: each token a decode query one key longer than the one before.
Against dense fp32 causal attention over decompressed keys and values, against the same
tokens decoded one by one, eagerly and through graph buffers padded to a larger batch, with
one split and several. Tiny shapes under the interpreter; the ``gpu`` test replays a captured
verification graph against eager."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from ops.mla_cases import DEVICE, dense_reference, latent_cache

import heron.kernels.mla_decode as mla
import heron.ops.mla.triton as mla_triton
from heron.cache.paged_parts import paged_layout
from heron.metadata import GraphSupport, ModelBuildContext, SequenceMetadata, StepBatch
from heron.ops.mla.base import MLASpec
from heron.ops.mla.triton import TritonMLA, TritonMLABuilder

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")

BLOCK_SIZE, WIDTH = 16, 8


def step(kv_lens: list[int], q: int, tables: torch.Tensor) -> SequenceMetadata:
    """``q`` new tokens per request at the end of its (written) entries; with ``q > 1`` every
    row verifies ``q - 1`` proposals."""
    n = len(kv_lens)
    batch = StepBatch(n, n * q, n * q, BLOCK_SIZE, [paged_layout(n, n * q, WIDTH)])
    batch.query_lens[:] = q
    batch.kv_lens[:] = kv_lens
    batch.positions[:] = [p for length in kv_lens for p in range(length - q, length)]
    batch.group_parts[0]["block_tables"][:] = tables.cpu().numpy()
    batch.logits_indices[:] = range(n * q)
    batch.finish()
    seq = SequenceMetadata.from_step_batch(batch, DEVICE)
    return replace(seq, num_proposed_host=np.full(n, q - 1)) if q > 1 else seq


def one_by_one(kv_lens: list[int], q: int, tables: torch.Tensor) -> SequenceMetadata:
    """The same tokens as decode rows, token ``i`` of a request seeing its first keys up to
    its own."""
    lens = [n - q + 1 + i for n in kv_lens for i in range(q)]
    return step(lens, 1, tables.repeat_interleave(q, dim=0))


def operator(heads: int, lora: int, rope: int) -> TritonMLA:
    spec = MLASpec(heads, lora, 16, rope, 16, (16 + rope) ** -0.5)
    return TritonMLA("l0", spec, BLOCK_SIZE, WIDTH * BLOCK_SIZE, None, None, ModelBuildContext())


@pytest.mark.parametrize("min_keys", [64, 8])  # one split, several
def test_verification_equals_dense_attention_and_token_by_token_decode(monkeypatch, min_keys):
    monkeypatch.setattr(mla, "LAUNCH", replace(mla.LAUNCH, min_keys_per_split=min_keys))
    monkeypatch.setattr(mla_triton, "multiprocessor_count", lambda device: 64)
    heads, lora, rope, q_len, kv_lens = 4, 32, 8, 3, [40, 3, 21]
    op = operator(heads, lora, rope)
    builder = op.metadata_builder()
    assert builder.graph_support is GraphSupport.UNIFORM
    op.kv_cache, tables, dense = latent_cache(kv_lens, BLOCK_SIZE, lora + rope, torch.float32)
    tables = torch.cat([tables, tables.new_zeros(3, WIDTH - tables.shape[1])], 1)
    gen = torch.Generator().manual_seed(2)
    w_uk = torch.randn(heads, 16, lora, generator=gen) / lora**0.5
    w_uv = torch.randn(heads, 16, lora, generator=gen) / lora**0.5
    q_nope = torch.randn(len(kv_lens) * q_len, heads, 16, generator=gen)
    q_rope = torch.randn(len(kv_lens) * q_len, heads, rope, generator=gen)
    q = torch.cat([torch.einsum("thn,hnl->thl", q_nope, w_uk), q_rope], -1).to(DEVICE)

    view = builder.build(step(kv_lens, q_len, tables))
    assert op.decodes(view) and view.workspace.query_len == q_len
    assert view.workspace.max_splits == (1 if min_keys == 64 else 5)
    verified = op.attend_latent(q, view)
    want = dense_reference(q_nope, q_rope, dense, [q_len] * len(kv_lens), w_uk, w_uv, op.spec.scale)
    got = torch.einsum("thl,hvl->thv", verified.cpu(), w_uv)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    decoded = op.attend_latent(q, builder.build(one_by_one(kv_lens, q_len, tables)))
    torch.testing.assert_close(verified, decoded, rtol=1e-5, atol=1e-5)

    # Graph buffers of a larger batch: padded rows attend to nothing; the plan is per request.
    buffers = builder.make_graph_buffers(4, DEVICE, max_query_len=q_len)
    seq = step(kv_lens, q_len, tables)
    builder.fill(seq, buffers, 4)
    graph_view = builder.graph_view(seq, buffers, 4)
    builder.before_capture(buffers)
    padded = torch.cat([q, torch.randn(q_len, heads, lora + rope, device=DEVICE)])
    replayed = op.attend_latent(padded, graph_view)
    torch.testing.assert_close(replayed[: len(kv_lens) * q_len], verified, rtol=1e-5, atol=1e-5)
    assert not replayed[len(kv_lens) * q_len :].any()
    assert buffers.plan.num_splits.numel() == 4


def test_steps_that_are_not_uniform_verification_run_the_extend_kernel():
    op = operator(2, 32, 8)
    tables = torch.zeros(2, WIDTH, dtype=torch.int32, device=DEVICE)
    prefill = replace(step([5, 5], 3, tables), num_proposed_host=None)
    assert not op.decodes(op.metadata_builder().build(prefill))


@pytest.mark.gpu
def test_replayed_verification_graph_equals_eager(monkeypatch):
    """bf16 at DeepSeek's latent shape: a (rows, q) verification graph captured on a dummy
    step (the plan recomputed inside it) and replayed on long contexts equals eager."""
    monkeypatch.setattr(mla, "LAUNCH", replace(mla.LAUNCH, min_keys_per_split=64))
    spec = MLASpec(16, 512, 128, 64, 128, 0.1)
    block_size, kv_lens, q_len, batch = 64, [900, 2000, 300], 4, 4
    op = TritonMLA("l0", spec, block_size, 4096, None, None, ModelBuildContext())
    builder: TritonMLABuilder = op.metadata_builder()
    op.kv_cache, tables, _ = latent_cache(kv_lens, block_size, 576, torch.bfloat16)
    tables = torch.cat([tables, tables.new_zeros(3, 64 - tables.shape[1])], 1)

    def uniform(lens, table_rows):
        n = len(lens)
        b = StepBatch(n, n * q_len, n * q_len, block_size, [paged_layout(n, n * q_len, 64)])
        b.query_lens[:] = q_len
        b.kv_lens[:] = lens
        b.group_parts[0]["block_tables"][:] = table_rows.cpu().numpy()
        b.logits_indices[:] = range(n * q_len)
        b.finish()
        seq = SequenceMetadata.from_step_batch(b, DEVICE)
        return replace(seq, num_proposed_host=np.full(n, q_len - 1))

    q = torch.randn(batch * q_len, 16, 576, dtype=torch.bfloat16, device=DEVICE)
    real = uniform(kv_lens, tables)
    eager = op.attend_latent(q[: 3 * q_len], builder.build(real))
    buffers = builder.make_graph_buffers(batch, DEVICE, max_query_len=q_len)
    dummy = uniform([q_len] * batch, torch.zeros(batch, 64, dtype=torch.int32))
    builder.fill(dummy, buffers, batch)
    view = builder.graph_view(dummy, buffers, batch)
    assert view.workspace.max_splits > 1 and view.workspace.query_len == q_len
    op.attend_latent(q, view)  # warm-up
    builder.before_capture(buffers)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = op.attend_latent(q, view)
    builder.fill(real, buffers, batch)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured[: 3 * q_len], eager, rtol=2e-2, atol=2e-2)
    assert not captured[3 * q_len :].any()
