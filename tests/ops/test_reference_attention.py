"""ReferenceAttention on a shuffled paged cache against dense fp32 SDPA with explicit masks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from heron.cache.paged_parts import PagedParts, paged_layout
from heron.metadata import ModelBuildContext, SequenceMetadata, StepBatch, StepMetaPlan
from heron.ops.attention.base import AttentionSpec
from heron.ops.attention.paged import PagedAttentionBuilder, PagedGraphBuffers
from heron.ops.attention.reference import ReferenceAttention

from tiny_models import attend

HEAD_DIM = 16
MAX_MODEL_LEN = 64
CPU = torch.device("cpu")
TOL = dict(atol=1e-5, rtol=1e-5)


def dense_attention(
    q, k, v, q_start: int, window: int | None, scale: float, softcap=None, sinks=None
) -> torch.Tensor:
    """q: [n, H, D] at positions q_start.. ; k, v: [L, KVH, D] at positions 0..L-1 (fp32).

    ``softcap``: Gemma 2's cap * tanh(scores / cap); ``sinks``: gpt-oss's per-head logit that
    joins the softmax and is dropped after it."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    q_pos = torch.arange(q_start, q_start + q.shape[0])[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= q_pos - k_pos < window
    if softcap is not None or sinks is not None:
        scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is not None:
            sink = sinks.double()[:, None, None].expand(-1, scores.shape[1], 1)
            scores = torch.cat([scores, sink], dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., : k.shape[0]]
        return torch.einsum("hqk,khd->qhd", probs, v.double()).float()
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).double(),
        k.transpose(0, 1).double(),
        v.transpose(0, 1).double(),
        attn_mask=mask,
        scale=scale,
    )
    return out.transpose(0, 1).float()


def first_table_block(context: int, window: int | None, block_size: int) -> int:
    """The table index a row starts at: the block of the first key a token at ``context``
    sees (``SlidingWindowSpec.first_table_block``); 0 without a window."""
    return 0 if window is None else max(context - window + 1, 0) // block_size


class PagedHarness:
    """One attention operator, its plan, a paged cache with shuffled block ids and the dense
    history of every request; :meth:`step` runs one scheduler step through the operator."""

    def __init__(
        self,
        block_size: int,
        heads: tuple[int, int],
        window: int | None,
        num_blocks: int = 48,
        seed: int = 0,
        softcap: float | None = None,
        sinks: bool = False,
    ) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.block_size = block_size
        num_heads, num_kv_heads = heads
        self.spec = AttentionSpec(
            num_heads, num_kv_heads, HEAD_DIM, HEAD_DIM**-0.5, window, softcap, sinks
        )
        self.sinks = torch.randn(num_heads, generator=self.gen) if sinks else None
        with ModelBuildContext() as scope:
            self.op = ReferenceAttention(
                "layers.0.attn", self.spec, block_size, MAX_MODEL_LEN, sinks=self.sinks
            )
        self.plan = StepMetaPlan.from_operators(scope.operators)
        self.cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, HEAD_DIM)
        self.op.bind_cache(self.cache)
        # Block 0 is the reserved null block; hand out the others in a random order.
        self.free = (torch.randperm(num_blocks - 1, generator=self.gen) + 1).tolist()
        self.tables: dict[str, list[int]] = {}
        self.k_hist: dict[str, torch.Tensor] = {}
        self.v_hist: dict[str, torch.Tensor] = {}
        self.last_view = None

    def _rand(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen)

    def make_seq(self, work: list[tuple[str, int]]) -> tuple[SequenceMetadata, StepBatch]:
        """Allocate blocks and lay out the step's StepBatch (as the runner does)."""
        bs = self.block_size
        for rid, n in work:
            table = self.tables.setdefault(rid, [])
            total = len(self.k_hist.get(rid, ())) + n
            while len(table) * bs < total:
                table.append(self.free.pop())
        num_tokens = sum(n for _, n in work)
        width = max(len(self.tables[rid]) for rid, _ in work)
        batch = StepBatch(
            len(work), num_tokens, len(work), bs, [paged_layout(len(work), num_tokens, width)]
        )
        parts = batch.group_parts[0]
        offset = 0
        for i, (rid, n) in enumerate(work):
            c = len(self.k_hist.get(rid, ()))
            table = self.tables[rid]
            batch.query_lens[i] = n
            batch.kv_lens[i] = c + n
            # A windowed row starts at the window (the runner's layout; see PagedAttentionBuilder)
            first = first_table_block(c, self.spec.sliding_window, bs)
            parts["block_tables"][i, : len(table) - first] = table[first:]
            parts["table_starts"][i] = first
            positions = torch.arange(c, c + n)
            batch.positions[offset : offset + n] = positions.numpy()
            batch.token_ids[offset : offset + n] = 7  # unused by attention
            slots = [table[p // bs] * bs + p % bs for p in positions.tolist()]
            parts["slot_mapping"][offset : offset + n] = slots
            offset += n
            batch.logits_indices[i] = offset - 1
        batch.finish()
        return SequenceMetadata.from_step_batch(batch, CPU), batch

    def step(self, work: list[tuple[str, int]]) -> None:
        """Run one step of ``(request id, new tokens)`` and check output and cache writes."""
        seq, _ = self.make_seq(work)
        self.plan.build_views(seq)
        self.last_view = self.op.view
        spec = self.spec
        num_tokens = seq.num_tokens
        q = self._rand(num_tokens, spec.num_heads, HEAD_DIM)
        k = self._rand(num_tokens, spec.num_kv_heads, HEAD_DIM)
        v = self._rand(num_tokens, spec.num_kv_heads, HEAD_DIM)
        out = attend(self.op, q, k, v)
        assert out.shape == q.shape and out.dtype == torch.float32

        offset = 0
        empty = torch.zeros(0, spec.num_kv_heads, HEAD_DIM)
        for rid, n in work:
            c = len(self.k_hist.get(rid, ()))
            k_full = torch.cat([self.k_hist.get(rid, empty), k[offset : offset + n]])
            v_full = torch.cat([self.v_hist.get(rid, empty), v[offset : offset + n]])
            self.k_hist[rid], self.v_hist[rid] = k_full, v_full
            expected = dense_attention(
                q[offset : offset + n],
                k_full,
                v_full,
                c,
                spec.sliding_window,
                spec.scale,
                spec.logit_softcap,
                self.sinks,
            )
            torch.testing.assert_close(out[offset : offset + n], expected, **TOL)
            offset += n
        self.check_cache()

    def check_cache(self, null_block_clean: bool = True) -> None:
        """Every request's whole history sits at its slots; the null block was never written
        (graph steps' padded rows do write it: pass ``null_block_clean=False``)."""
        bs = self.block_size
        for rid, table in self.tables.items():
            length = len(self.k_hist[rid])
            pos = torch.arange(length)
            blocks = torch.tensor(table)[pos // bs]
            torch.testing.assert_close(self.cache[0, blocks, pos % bs], self.k_hist[rid])
            torch.testing.assert_close(self.cache[1, blocks, pos % bs], self.v_hist[rid])
        if null_block_clean:
            assert not self.cache[:, 0].any(), "the null block 0 was written"
        used = {b for table in self.tables.values() for b in table}
        unused = [b for b in range(1, self.cache.shape[1]) if b not in used]
        assert not self.cache[:, unused].any(), "a block nobody owns was written"


CONFIGS = [
    pytest.param(bs, heads, window, id=f"bs{bs}-h{heads[0]}kv{heads[1]}-w{window}")
    for bs in (4, 16)
    for heads in ((8, 2), (4, 1))
    for window in (None, 5)
]


@pytest.mark.parametrize("block_size, heads, window", CONFIGS)
def test_prefill_only(block_size, heads, window):
    h = PagedHarness(block_size, heads, window)
    h.step([("a", 7), ("b", 19), ("c", 2)])
    assert not h.last_view.is_decode


@pytest.mark.parametrize("block_size, heads, window", CONFIGS)
def test_extend_with_history(block_size, heads, window):
    h = PagedHarness(block_size, heads, window)
    h.step([("a", 7), ("b", 19), ("c", 2)])
    # New chunks attend to the cached history and causally to themselves.
    h.step([("a", 5), ("b", 3), ("c", 9)])
    h.step([("b", 11)])
    assert not h.last_view.is_decode


@pytest.mark.parametrize("block_size, heads, window", CONFIGS)
def test_decode_batch(block_size, heads, window):
    h = PagedHarness(block_size, heads, window)
    h.step([("a", 7), ("b", 19), ("c", 2), ("d", 1)])
    for _ in range(4):  # different KV lengths; some cross block boundaries
        h.step([("a", 1), ("b", 1), ("c", 1), ("d", 1)])
        assert h.last_view.is_decode


@pytest.mark.parametrize("block_size, heads, window", CONFIGS)
def test_mixed_batch(block_size, heads, window):
    h = PagedHarness(block_size, heads, window)
    h.step([("a", 9), ("b", 6)])
    # decode + extend + fresh prefill in one step
    h.step([("a", 1), ("b", 6), ("c", 11)])
    assert not h.last_view.is_decode
    h.step([("c", 1), ("a", 3), ("b", 1)])


def test_sliding_window_changes_the_result():
    """Guard against a vacuous window: with context > window, the window matters."""
    outs = []
    for window in (None, 5):
        h = PagedHarness(4, (4, 1), window, seed=3)
        h.step([("a", 12)])
        seq, _ = h.make_seq([("a", 1)])
        h.plan.build_views(seq)
        g = torch.Generator().manual_seed(9)
        q = torch.randn(1, 4, HEAD_DIM, generator=g)
        kv = torch.randn(2, 1, 1, HEAD_DIM, generator=g)
        outs.append(attend(h.op, q, kv[0], kv[1]))
    assert not torch.allclose(outs[0], outs[1], atol=1e-3)


# --------------------------------------------------------------------------- graph buffers


def test_graph_buffers_shape_is_bounded_by_max_model_len():
    builder = PagedAttentionBuilder("reference", 16, None, MAX_MODEL_LEN)
    buffers = builder.make_graph_buffers(8, CPU)
    assert isinstance(buffers, PagedGraphBuffers)
    assert buffers.block_tables.shape == (8, MAX_MODEL_LEN // 16)
    assert buffers.slot_mapping.shape == (8,) and buffers.kv_lens.shape == (8,)
    assert buffers.query_start_loc.tolist() == list(range(9))
    # Not as wide as the pool (the harness' pool has 48 blocks), nor one per bucket.
    odd = PagedAttentionBuilder("reference", 16, None, 50)
    assert odd.make_graph_buffers(4, CPU).block_tables.shape == (4, math.ceil(50 / 16))


@pytest.mark.parametrize("window", [None, 5])
def test_graph_fill_pads_rows_and_matches_eager(window):
    h = PagedHarness(4, (8, 2), window, seed=1)
    h.step([("a", 7), ("b", 13), ("c", 3)])
    builder = h.op.metadata_builder()
    group = h.op.group
    buffers = builder.make_graph_buffers(8, CPU)

    seq, _ = h.make_seq([("a", 1), ("b", 1), ("c", 1)])
    assert seq.is_decode
    g = torch.Generator().manual_seed(5)
    q = torch.randn(3, 8, HEAD_DIM, generator=g)
    k = torch.randn(3, 2, HEAD_DIM, generator=g)
    v = torch.randn(3, 2, HEAD_DIM, generator=g)

    group.view = builder.build(seq)
    eager = attend(h.op, q, k, v)
    cache_after_eager = h.cache.clone()

    batch = 6
    builder.fill(seq, buffers, batch)
    view = builder.graph_view(seq, buffers, batch)
    group.view = view
    assert view.is_decode and view.num_reqs == batch
    # Bounded by max_model_len, or by the window: 5 keys span at most 2 blocks of 4.
    assert view.block_tables.shape == (batch, MAX_MODEL_LEN // 4 if window is None else 2)
    # The view is written in place into the persistent buffers.
    assert view.block_tables.data_ptr() == buffers.block_tables.data_ptr()
    assert view.kv_lens.data_ptr() == buffers.kv_lens.data_ptr()
    assert view.kv_lens[:3].tolist() == seq.kv_lens.tolist()
    parts = seq.parts(0, PagedParts)
    assert view.slot_mapping[:3].tolist() == parts.slot_mapping.tolist()
    width = min(parts.block_tables.shape[1], view.block_tables.shape[1])
    assert torch.equal(view.block_tables[:3, :width], parts.block_tables[:, :width])
    assert not view.block_tables[:3, width:].any()
    assert not parts.block_tables[:, width:].any(), "a windowed row fits the window's width"
    # Padded rows: length 0, null block, slot 0.
    assert not view.kv_lens[3:].any()
    assert not view.block_tables[3:].any()
    assert not view.slot_mapping[3:].any()
    assert not view.table_starts[3:].any()

    pad = lambda t: torch.cat([t, torch.randn(batch - 3, *t.shape[1:], generator=g)])
    graph_out = attend(h.op, pad(q), pad(k), pad(v))
    torch.testing.assert_close(graph_out[:3], eager, atol=1e-6, rtol=1e-6)
    assert torch.isfinite(graph_out).all()
    assert not graph_out[3:].any(), "padded rows attend to nothing"
    # Padded rows' K/V went to the null block only; real blocks hold what eager wrote.
    torch.testing.assert_close(h.cache[:, 1:], cache_after_eager[:, 1:])

    # A later, smaller step reuses the buffers and resets the rows that were real before.
    for i, rid in enumerate("abc"):  # the decode step above appended one token to each
        h.k_hist[rid] = torch.cat([h.k_hist[rid], k[i : i + 1]])
        h.v_hist[rid] = torch.cat([h.v_hist[rid], v[i : i + 1]])
    h.check_cache(null_block_clean=False)
    seq2, _ = h.make_seq([("c", 1)])
    builder.fill(seq2, buffers, batch)
    view2 = builder.graph_view(seq2, buffers, batch)
    first = first_table_block(len(h.k_hist["c"]), window, 4)
    table_c = h.tables["c"][first:]
    assert view2.kv_lens.tolist() == [len(h.k_hist["c"]) + 1] + [0] * (batch - 1)
    assert view2.table_starts.tolist() == [first] + [0] * (batch - 1)
    slots2 = seq2.parts(0, PagedParts).slot_mapping.tolist()
    assert view2.slot_mapping.tolist() == slots2 + [0] * (batch - 1)
    assert view2.block_tables[0, : len(table_c)].tolist() == table_c
    assert not view2.block_tables[0, len(table_c) :].any()
    assert not view2.block_tables[1:].any(), "stale block-table rows survived"
    # Back to the first step's shape: the buffers take its rows again (the fill keeps only the
    # last shape's destination views).
    builder.fill(seq, buffers, batch)
    assert view.kv_lens[:3].tolist() == seq.kv_lens.tolist()
    assert torch.equal(view.block_tables[:3, :width], parts.block_tables[:, :width])


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize(
    ("softcap", "sinks"),
    [(2.0, False), (None, True), (3.0, True)],
    ids=["softcap", "sinks", "both"],
)
def test_softcap_and_sinks(softcap, sinks, window):
    """Gemma 2's logit soft-capping and gpt-oss's sinks through prefill, extend and decode."""
    h = PagedHarness(16, (8, 2), window, softcap=softcap, sinks=sinks)
    h.step([("a", 11), ("b", 3)])
    h.step([("a", 1), ("b", 6)])
    h.step([("a", 1), ("b", 1)])
