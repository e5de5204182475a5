"""Steps the Triton attention operator runs beyond plain decode, against dense fp32 attention,
tiny shapes under the Triton interpreter.

Verification steps through graph buffers: ``q`` new tokens per row (the last token and the
proposals after it) filled into the Triton builder's buffers, padded to a larger batch, then the
kernels over the buffers' view (what a replayed verification graph runs): the extend kernel,
and the decode kernel with a program per token, which the operator runs for such steps; padded
rows attend to nothing. And mixed steps: the running requests' one-token rows first, then
prefill chunks; the leading one-token rows go to the decode kernel, the rest to the extend
kernel, into one output."""

from __future__ import annotations

import pytest
import torch
from test_triton_attention_kernels import (
    DEVICE,
    HEAD_DIM,
    assert_close,
    dense_attention,
    make_paged_cache,
    make_sinks,
    strided_q,
    window_rows,
)

from heron.cache.paged_parts import paged_layout
from heron.kernels.attention_decode import paged_decode_attention
from heron.kernels.attention_extend import paged_extend_attention
from heron.metadata import (
    GraphSupport,
    ModelBuildContext,
    SequenceMetadata,
    StepBatch,
    StepMetadataError,
)
from heron.ops.attention.base import AttentionSpec
from heron.ops.attention.triton import operator as operator_module
from heron.ops.attention.triton.operator import (
    MAX_DECODE_QUERIES,
    LeadingDecodeRows,
    TritonAttention,
    TritonAttentionBuilder,
)

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")


def uniform_step(
    kv_lens: list[int], q: int, tables: torch.Tensor, block_size: int, window: int | None
) -> SequenceMetadata:
    """``q`` new tokens per request, at the end of each one's (already written) keys."""
    return paged_step(kv_lens, [q] * len(kv_lens), tables, block_size, window)


def paged_step(
    kv_lens: list[int], q_lens: list[int], tables: torch.Tensor, block_size: int, window
) -> SequenceMetadata:
    """Request ``r``'s ``q_lens[r]`` new tokens at the end of its (already written) keys."""
    n, tokens = len(kv_lens), sum(q_lens)
    tables, starts = window_rows(tables, kv_lens, q_lens, window, block_size)
    step = StepBatch(n, tokens, tokens, block_size, [paged_layout(n, tokens, tables.shape[1])])
    step.query_lens[:] = q_lens
    step.kv_lens[:] = kv_lens
    step.positions[:] = [p for k, q in zip(kv_lens, q_lens) for p in range(k - q, k)]
    step.group_parts[0]["block_tables"][:] = tables.cpu().numpy()
    step.group_parts[0]["table_starts"][:] = starts.cpu().numpy()
    step.logits_indices[:] = range(tokens)
    step.finish()
    return SequenceMetadata.from_step_batch(step, DEVICE)


def assert_rows_match_dense(out, q, ks, vs, q_len, window, scale, sinks) -> None:
    """Request ``r``'s ``q_len`` tokens (rows ``r * q_len`` on) against dense fp32 attention;
    the padded rows after the requests' attend to nothing."""
    for r, (k, v) in enumerate(zip(ks, vs)):
        rows = slice(r * q_len, (r + 1) * q_len)
        assert_close(out[rows], dense_attention(q[rows], k, v, window, scale, sinks=sinks), 1e-4)
    assert not out[len(ks) * q_len :].any(), "padded rows attend to nothing"


@pytest.mark.parametrize("window, sinks", [(None, False), (6, True)])
def test_verification_step_through_graph_buffers_matches_dense(window, sinks):
    heads, kv_heads, block_size, q_len, batch = 4, 2, 4, 3, 4
    spec = AttentionSpec(heads, kv_heads, HEAD_DIM, HEAD_DIM**-0.5, window, has_sinks=sinks)
    builder = TritonAttentionBuilder(spec, block_size, max_model_len=64)
    assert builder.graph_support is GraphSupport.UNIFORM
    buffers = builder.make_graph_buffers(batch, DEVICE, max_query_len=q_len)
    kv_lens = [13, 5]
    cache, tables, ks, vs = make_paged_cache(
        kv_lens, block_size, kv_heads, HEAD_DIM, torch.float32, DEVICE
    )
    seq = uniform_step(kv_lens, q_len, tables, block_size, window)
    builder.fill(seq, buffers, batch)
    view = builder.graph_view(seq, buffers, batch)
    assert not view.is_decode and view.max_query_len == q_len and view.num_reqs == batch
    assert view.query_start_loc.tolist() == [0, 3, 6, 9, 12]
    assert view.positions.shape == (batch * q_len,) and not view.slot_mapping[6:].any()
    q = strided_q(batch * q_len, heads, HEAD_DIM, torch.float32, DEVICE, seed=3)
    sink_logits = make_sinks(heads, torch.float32, DEVICE) if sinks else None
    out = torch.full_like(q, float("nan"))
    paged_extend_attention(
        q, cache, view.block_tables, view.table_starts, view.query_start_loc, view.kv_lens,
        view.max_query_len, spec.scale, window, out, sinks=sink_logits,
    )  # fmt: skip
    assert_rows_match_dense(out, q, ks, vs, q_len, window, spec.scale, sink_logits)


@pytest.mark.parametrize(
    "kv_heads, kv_lens, batch, window, sinks",
    [
        (2, [13, 5], 4, None, False),  # padded rows, one split (8 rows fill 4 SMs)
        (2, [13, 5], 4, 6, True),
        (1, [150], 1, None, False),  # three rows of one KV head: split over the keys
        (1, [150], 1, 70, True),
    ],
)
def test_uniform_step_through_the_decode_kernel_matches_dense(
    kv_heads, kv_lens, batch, window, sinks, monkeypatch
):
    """The decode kernel, each of a row's ``q`` tokens a query row of its own that sees the
    keys up to its position, in the workspace the builder gives uniform steps (graph buffers,
    and eager), against dense attention. The builder sees 4 multiprocessors on any device,
    so that each case splits as on the interpreter."""
    monkeypatch.setattr(operator_module, "multiprocessor_count", lambda device: 4)
    heads, block_size, q_len = 4, 4, 3
    spec = AttentionSpec(heads, kv_heads, HEAD_DIM, HEAD_DIM**-0.5, window, has_sinks=sinks)
    builder = TritonAttentionBuilder(spec, block_size, max_model_len=256)
    buffers = builder.make_graph_buffers(batch, DEVICE, max_query_len=q_len)
    cache, tables, ks, vs = make_paged_cache(
        kv_lens, block_size, kv_heads, HEAD_DIM, torch.float32, DEVICE
    )
    seq = uniform_step(kv_lens, q_len, tables, block_size, window)
    builder.fill(seq, buffers, batch)
    q = strided_q(batch * q_len, heads, HEAD_DIM, torch.float32, DEVICE, seed=5)
    sink_logits = make_sinks(heads, torch.float32, DEVICE) if sinks else None
    for view in (builder.graph_view(seq, buffers, batch), builder.build(seq)):
        ws = view.workspace
        assert ws.queries_per_row == q_len
        assert (ws.num_splits > 1) == (len(kv_lens) == 1)
        rows = view.num_reqs * q_len
        out = torch.full_like(q[:rows], float("nan"))
        paged_decode_attention(
            q[:rows], cache, view.block_tables, view.table_starts, view.kv_lens, spec.scale,
            window, out, ws.num_splits, ws.partial_out, ws.partial_lse, ws.tickets,
            sinks=sink_logits, queries_per_row=q_len,
        )  # fmt: skip
        assert_rows_match_dense(out, q[:rows], ks, vs, q_len, window, spec.scale, sink_logits)


def test_longer_uniform_steps_stay_on_the_extend_kernel():
    spec = AttentionSpec(2, 1, HEAD_DIM, HEAD_DIM**-0.5, None)
    builder = TritonAttentionBuilder(spec, 4, max_model_len=64)
    q_len = MAX_DECODE_QUERIES + 1
    cache, tables, _, _ = make_paged_cache([20], 4, 1, HEAD_DIM, torch.float32, DEVICE)
    assert builder.build(uniform_step([20], q_len, tables, 4, None)).workspace is None


def test_graph_buffers_refuse_steps_that_are_not_uniform():
    spec = AttentionSpec(2, 1, HEAD_DIM, HEAD_DIM**-0.5, None)
    builder = TritonAttentionBuilder(spec, 4, max_model_len=64)
    buffers = builder.make_graph_buffers(4, DEVICE, max_query_len=2)
    cache, tables, _, _ = make_paged_cache([9], 4, 1, HEAD_DIM, torch.float32, DEVICE)
    with pytest.raises(StepMetadataError, match="same query length"):
        builder.fill(uniform_step([9], 3, tables, 4, None), buffers, 4)  # longer than captured
    mixed = StepBatch(2, 3, 3, 4, [paged_layout(2, 3, tables.shape[1])])
    mixed.query_lens[:] = [2, 1]
    mixed.kv_lens[:] = [9, 9]
    mixed.finish()
    with pytest.raises(StepMetadataError, match="same query length"):
        builder.fill(SequenceMetadata.from_step_batch(mixed, DEVICE), buffers, 4)


@pytest.mark.parametrize(
    "kv_heads, kv_lens, q_lens, decode_rows, window, sinks",
    [
        (2, [13, 9, 20, 6], [1, 1, 7, 6], 2, None, False),
        (2, [13, 9, 20, 6], [1, 1, 7, 6], 2, 5, True),
        (1, [150, 30], [1, 12], 1, None, False),  # one row of one KV head: split keys
        (2, [20, 13, 9], [7, 1, 1], 0, None, False),  # a prefill first: all on extend
    ],
)
def test_mixed_step_matches_dense(kv_heads, kv_lens, q_lens, decode_rows, window, sinks):
    heads, block_size = 4, 4
    spec = AttentionSpec(heads, kv_heads, HEAD_DIM, HEAD_DIM**-0.5, window, has_sinks=sinks)
    sink_logits = make_sinks(heads, torch.float32, DEVICE) if sinks else None
    op = TritonAttention(
        "layer", spec, block_size, 256, build_context=ModelBuildContext(), sinks=sink_logits
    )
    cache, tables, ks, vs = make_paged_cache(
        kv_lens, block_size, kv_heads, HEAD_DIM, torch.float32, DEVICE
    )
    op.bind_cache(cache)
    view = op.metadata_builder().build(paged_step(kv_lens, q_lens, tables, block_size, window))
    ws = view.workspace
    assert (ws.rows if isinstance(ws, LeadingDecodeRows) else 0) == decode_rows
    if decode_rows and kv_heads == 1:
        assert ws.decode.num_splits > 1
    q = strided_q(sum(q_lens), heads, HEAD_DIM, torch.float32, DEVICE, seed=7)
    out = op.forward_extend(q, view)
    first = 0
    for k, v, n in zip(ks, vs, q_lens):
        rows = slice(first, first + n)
        assert_close(
            out[rows], dense_attention(q[rows], k, v, window, spec.scale, sinks=sink_logits), 1e-4
        )
        first += n
