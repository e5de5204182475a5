"""Triton paged decode/extend kernels against dense fp32 SDPA with explicit masks (or, with
Gemma 2's logit soft-cap or gpt-oss's sinks, an explicit fp32 softmax as in the reference
operator).

Small cases run everywhere (under the Triton interpreter on CPU: ``tests/conftest.py`` sets
``TRITON_INTERPRET=1`` before triton loads when there is no GPU); ``gpu`` cases use realistic
bf16 shapes and CUDA-graph capture. Caches use shuffled block ids and are NaN everywhere no
token was written, so any read outside a request's visible keys shows up as NaN. Every call
given a split workspace must leave its tickets at zero (the next layer or graph replay reuses
them without a reset).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from triton_lowering import check_lowering

from heron.cache.paged_parts import paged_layout
from heron.kernels.attention_decode import (
    choose_num_splits,
    paged_decode_attention,
    tickets_needed,
)
from heron.kernels.attention_extend import paged_extend_attention
from heron.metadata import SequenceMetadata, StepBatch
from heron.ops.attention.base import AttentionSpec
from heron.ops.attention.triton.operator import TritonAttentionBuilder

# The interpreter converts its 1-element scalars to loop bounds through a deprecated numpy path.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HEAD_DIM = 64


def make_paged_cache(
    kv_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """A NaN-filled cache holding random K/V for each request in shuffled blocks (0 reserved).

    Returns (kv_cache, block_tables, dense K per request, dense V per request); the dense
    tensors are fp32 ``[kv_len, KVH, D]`` copies of exactly what the cache holds.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-n // block_size) for n in kv_lens]
    num_blocks = 1 + sum(blocks_per_req) + 3  # null block + requests' + a few spare
    width = max(blocks_per_req + [1]) + 1
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    tables = torch.zeros(len(kv_lens), width, dtype=torch.int32)
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    dense_k, dense_v = [], []
    for r, (n, nblk) in enumerate(zip(kv_lens, blocks_per_req)):
        ids = [free.pop() for _ in range(nblk)]
        tables[r, :nblk] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        pos = torch.arange(n)
        slots = torch.tensor(ids, dtype=torch.long)[pos // block_size] * block_size
        slots += pos % block_size
        cache[0].view(-1, num_kv_heads, head_dim)[slots] = k.float()
        cache[1].view(-1, num_kv_heads, head_dim)[slots] = v.float()
        dense_k.append(k.float().to(device))
        dense_v.append(v.float().to(device))
    return cache.to(dtype).to(device), tables.to(device), dense_k, dense_v


def window_rows(
    tables: torch.Tensor, kv_lens: list[int], q_lens: list[int], window: int | None, bs: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``tables`` in the windowed layout the step metadata holds, and each row's table start:
    a row starts at the block of the first key its request's first new token sees."""
    firsts = [
        0 if window is None else max(k - q - window + 1, 0) // bs for k, q in zip(kv_lens, q_lens)
    ]
    rows = torch.zeros_like(tables)
    for r, first in enumerate(firsts):
        rows[r, : tables.shape[1] - first] = tables[r, first:]
    return rows, torch.tensor(firsts, dtype=torch.int32, device=tables.device)


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int | None,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    key_limits: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [n, H, D], the last n of the kv_len positions; k, v: [kv_len, KVH, D]; fp32 result.

    ``softcap``: scores become cap * tanh(scores / cap) before the mask (Gemma 2); ``sinks``
    [H]: one more logit per head joins the softmax, its probability dropped (gpt-oss);
    ``key_limits`` [n]: the last position each query sees, in place of its own."""
    n, kv_len = q.shape[0], k.shape[0]
    if kv_len == 0:
        return torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    q_pos = torch.arange(kv_len - n, kv_len, device=q.device)[:, None]
    k_pos = torch.arange(kv_len, device=q.device)[None, :]
    mask = k_pos <= (q_pos if key_limits is None else key_limits[:, None])
    if window is not None:
        mask &= k_pos > q_pos - window
    if softcap is not None or sinks is not None:
        scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is not None:
            sink = sinks.float()[:, None, None].expand(-1, n, 1)
            scores = torch.cat([scores, sink], dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., :kv_len]
        return torch.einsum("hqk,khd->qhd", probs, v)
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        scale=scale,
    )
    return out.transpose(0, 1)


def strided_q(tokens: int, heads: int, head_dim: int, dtype, device, seed: int) -> torch.Tensor:
    """Random q as a head slice of a wider tensor, like q split out of a fused qkv projection."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(tokens, heads + 3, head_dim, generator=gen).to(dtype).to(device)
    return wide[:, :heads]


def make_sinks(heads: int, dtype, device) -> torch.Tensor:
    """Sink logits around exp(2): comparable to the keys' total weight, so they matter."""
    gen = torch.Generator().manual_seed(3)
    return (2.0 + torch.randn(heads, generator=gen)).to(dtype).to(device)


def decode_reference(q, ks, vs, window, scale, softcap=None, sinks=None) -> torch.Tensor:
    """Dense fp32 attention of each request's one query row (``q`` [B, H, D]) over its keys
    (``ks``, ``vs``: one [kv_len, KVH, D] per request, at least B)."""
    rows = [
        dense_attention(q[r : r + 1], ks[r], vs[r], window, scale, softcap, sinks)
        for r in range(q.shape[0])
    ]
    return torch.cat(rows)


def run_decode(
    kv_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    window: int | None,
    num_splits: int,
    dtype: torch.dtype,
    head_dim: int = HEAD_DIM,
    workspace: bool = False,
    device: torch.device = DEVICE,
    softcap: float | None = None,
    sinks: bool = False,
    tickets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel output, dense reference) for one decode step; ``sinks`` draws random ones.
    ``workspace`` passes fresh split buffers, ``tickets`` a given (zero) ticket buffer."""
    cache, tables, ks, vs = make_paged_cache(
        kv_lens, block_size, num_kv_heads, head_dim, dtype, device
    )
    tables, starts = window_rows(tables, kv_lens, [1] * len(kv_lens), window, block_size)
    batch, scale = len(kv_lens), head_dim**-0.5
    q = strided_q(batch, num_heads, head_dim, dtype, device, seed=1)
    sink_logits = make_sinks(num_heads, dtype, device) if sinks else None
    out = torch.full_like(q, float("nan"))
    ws = {}
    if workspace:  # NaN where no split wrote: the merge must read only what splits wrote
        shape = (batch, num_heads, num_splits)
        ws = dict(
            partial_out=torch.full((*shape, head_dim), float("nan"), device=device),
            partial_lse=torch.full(shape, float("nan"), device=device),
            tickets=torch.zeros(
                tickets_needed(batch, num_kv_heads, num_splits), dtype=torch.int32, device=device
            ),
        )
    if tickets is not None:
        ws["tickets"] = tickets
    lens = torch.tensor(kv_lens, dtype=torch.int32, device=device)
    paged_decode_attention(
        q, cache, tables, starts, lens, scale, window, out, num_splits, **ws,
        softcap=softcap, sinks=sink_logits,
    )  # fmt: skip
    if "tickets" in ws:
        assert not ws["tickets"].any(), "the merging programs reset their tickets"
    return out, decode_reference(q, ks, vs, window, scale, softcap, sink_logits)


def run_extend(
    kv_lens: list[int],
    q_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    window: int | None,
    dtype: torch.dtype,
    head_dim: int = HEAD_DIM,
    device: torch.device = DEVICE,
    softcap: float | None = None,
    sinks: bool = False,
    spans: dict[int, list[tuple[int, int]]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel output, dense reference) for one extend step (new tokens are the last q_lens);
    ``sinks`` draws random ones; ``spans``: per request, position ranges ``[a, b)`` whose
    tokens see the whole range (key limits ``b - 1``)."""
    cache, tables, ks, vs = make_paged_cache(
        kv_lens, block_size, num_kv_heads, head_dim, dtype, device
    )
    tables, table_starts = window_rows(tables, kv_lens, q_lens, window, block_size)
    scale = head_dim**-0.5
    q = strided_q(sum(q_lens), num_heads, head_dim, dtype, device, seed=2)
    sink_logits = make_sinks(num_heads, dtype, device) if sinks else None
    out = torch.full_like(q, float("nan"))
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    limits = None
    if spans is not None:
        per_request = []
        for r, (kv_len, n) in enumerate(zip(kv_lens, q_lens)):
            rows = torch.arange(kv_len - n, kv_len, dtype=torch.int32)
            for a, b in spans.get(r, []):
                rows[(rows >= a) & (rows < b)] = b - 1
            per_request.append(rows)
        limits = torch.cat(per_request).to(device)
    paged_extend_attention(
        q,
        cache,
        tables,
        table_starts,
        torch.tensor(starts, dtype=torch.int32, device=device),
        torch.tensor(kv_lens, dtype=torch.int32, device=device),
        max(q_lens),
        scale,
        window,
        out,
        softcap=softcap,
        sinks=sink_logits,
        key_limits=limits,
    )
    ref = torch.cat(
        [
            dense_attention(
                q[starts[r] : starts[r + 1]],
                ks[r],
                vs[r],
                window,
                scale,
                softcap,
                sink_logits,
                None if limits is None else limits[starts[r] : starts[r + 1]],
            )
            for r in range(len(kv_lens))
        ]
    )
    return out, ref


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


# (num_heads, num_kv_heads): GQA groups 1, 2, 4 and MQA.
HEADS = [(2, 2), (4, 2), (8, 2), (4, 1)]
SPLITS = [(1, False), (4, False), (4, True)]  # (num_splits, workspace passed)


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}")
@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("splits", SPLITS, ids=["s1", "s4", "s4ws"])
def test_decode_matches_dense(heads, block_size, window, splits):
    # 0: padded row (zeros), 1: single key, the rest cross tiles and blocks.
    kv_lens = [0, 1, 37, 130]
    out, ref = run_decode(
        kv_lens, *heads, block_size, window, splits[0], torch.float32, workspace=splits[1]
    )
    assert_close(out, ref, 1e-4)
    assert (out[0] == 0).all()


def test_decode_fp16_and_more_splits_than_tiles():
    # 16 splits over at most 3 tiles: most splits are empty and must be skipped by the merge.
    out, ref = run_decode([5, 150, 64, 0], 8, 2, 16, None, 16, torch.float16)
    assert_close(out, ref, 2e-3)


def test_choose_num_splits():
    assert choose_num_splits(64, 8, 4096, num_sms=132) == 1  # 512 programs fill the GPU
    assert choose_num_splits(33, 4, 1 << 20, num_sms=132) == 1  # 132 programs
    assert choose_num_splits(1, 8, 4096, num_sms=132) == 32  # 8 programs -> >= 132 in all
    # A split may be one 64-key tile: up to as many splits as tiles, as a power of two.
    assert choose_num_splits(1, 1, 40, num_sms=132) == 1  # [0, 40) is one tile
    assert choose_num_splits(1, 1, 0, num_sms=132) == 1
    assert choose_num_splits(1, 8, 200, num_sms=132) == 4
    assert choose_num_splits(1, 8, 300, num_sms=132) == 8  # 5 tiles
    assert choose_num_splits(1, 1, 4096, num_sms=132) == 64  # 64 tiles, one per split
    assert choose_num_splits(1, 1, 1 << 20, num_sms=132) == 128  # capped
    # A window's tiles start at its first key: 512 keys are 8 tiles (Gemma 3 1B's local layers).
    assert choose_num_splits(1, 1, 32768, num_sms=132, sliding_window=512) == 8
    assert choose_num_splits(1, 1, 8192, num_sms=132, sliding_window=4096) == 64
    assert choose_num_splits(1, 1, 8192, num_sms=132, sliding_window=4097) == 128  # 65 tiles
    assert choose_num_splits(64, 1, 4096, num_sms=132, sliding_window=512) == 4  # 2 tiles each
    assert choose_num_splits(1, 1, 400, num_sms=132, sliding_window=512) == 8  # 7 tiles from 0
    previous = 128
    for batch in range(1, 80):
        n = choose_num_splits(batch, 2, 2048, num_sms=132)
        assert 1 <= n <= previous and n & (n - 1) == 0  # shrinks as the batch grows
        previous = n


@pytest.mark.parametrize(
    "kv_lens,q_lens",
    [
        ([20, 70], [20, 70]),  # prefill only
        ([90, 133], [25, 64]),  # prefix-cache hit / chunked-prefill continuation
        ([50, 1, 81, 66], [1, 1, 17, 66]),  # mixed: decode-like rows beside prefills
    ],
    ids=["prefill", "history", "mixed"],
)
@pytest.mark.parametrize("heads", [(4, 2), (4, 1)], ids=["gqa", "mqa"])
def test_extend_matches_dense(kv_lens, q_lens, heads):
    out, ref = run_extend(kv_lens, q_lens, *heads, 16, None, torch.float32)
    assert_close(out, ref, 1e-4)


@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_extend_sliding_window(block_size):
    out, ref = run_extend([150, 40, 75], [80, 40, 1], 4, 2, block_size, 11, torch.float32)
    assert_close(out, ref, 1e-4)


@pytest.mark.parametrize("window", [None, 11])
def test_extend_key_limits(window):
    """Spans whose tokens see one another both ways (Gemma 3's images): one across the
    64-query tile boundary, one whose first tokens were computed in an earlier step, two in
    one request, and a text-only request beside them."""
    # (request 0's new tokens are positions 30..119: its 64-query tiles meet at 94)
    spans = {0: [(20, 40), (85, 100)], 1: [(10, 25), (100, 110)]}
    out, ref = run_extend(
        [120, 110, 30], [90, 104, 30], 4, 2, 16, window, torch.float32, spans=spans
    )
    assert_close(out, ref, 1e-4)
    causal, _ = run_extend([120, 110, 30], [90, 104, 30], 4, 2, 16, window, torch.float32)
    assert not torch.allclose(out[:90], causal[:90])  # the spans changed the first request
    torch.testing.assert_close(out[194:], causal[194:])  # and left the text-only one alone


def test_extend_fp16():
    out, ref = run_extend([100, 30], [70, 30], 4, 2, 32, None, torch.float16)
    assert_close(out, ref, 2e-3)


# Gemma 2's logit soft-cap (small enough to bite: the scores are about N(0, 1)) and gpt-oss's
# sinks, alone and together.
FEATURES = {
    "softcap": dict(softcap=1.5),
    "sinks": dict(sinks=True),
    "softcap+sinks": dict(softcap=1.5, sinks=True),
}


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("splits", SPLITS, ids=["s1", "s4", "s4ws"])
def test_decode_softcap_and_sinks(feature, window, splits):
    """One split finishes the softmax (and adds the sink) itself; several leave it to the
    merging program, which must add each head's sink exactly once."""
    kv_lens = [0, 1, 37, 130]
    out, ref = run_decode(
        kv_lens, 8, 2, 16, window, splits[0], torch.float32, workspace=splits[1],
        **FEATURES[feature],
    )  # fmt: skip
    assert_close(out, ref, 1e-4)
    assert (out[0] == 0).all(), "a padded row stays zero, sink or not"


@pytest.mark.parametrize("heads", [(16, 1), (8, 1), (2, 2)], ids=lambda h: f"h{h[0]}kv{h[1]}")
@pytest.mark.parametrize("feature", [None, "softcap+sinks"])
def test_decode_one_tile_splits(heads, feature):
    """16 splits of at most one tile, as the heuristic picks for short windows: the 530-key
    window of the longest row starts inside a cache block and is 9 tiles from there, the other
    rows fewer (their last splits are empty). With 8 and 16 query heads per KV head the merge
    takes the splits in several chunks (8 and 4 a chunk)."""
    kv_lens = [0, 1, 333, 700]
    out, ref = run_decode(
        kv_lens, *heads, 16, 530, 16, torch.float32, workspace=True,
        **FEATURES.get(feature, {}),
    )  # fmt: skip
    assert_close(out, ref, 1e-4)
    assert (out[0] == 0).all()


@pytest.mark.parametrize("splits", [32, 40], ids=["s32", "s40"])
@pytest.mark.parametrize("feature", [None, "softcap+sinks"])
def test_decode_two_level_merge(splits, feature):
    """More splits than one program merges (``_MERGE_GROUP``): groups merge first, then the
    groups (40: the last group is short). One row keeps two groups busy and a third partly,
    one only part of the first; a padded row has none."""
    kv_lens = [0, 2100, 100]
    out, ref = run_decode(
        kv_lens, 4, 2, 16, None, splits, torch.float32, head_dim=16, workspace=True,
        **FEATURES.get(feature, {}),
    )  # fmt: skip
    assert_close(out, ref, 1e-4)
    assert (out[0] == 0).all()


def test_decode_reuses_tickets():
    """One ticket buffer for launch after launch (the layers of a step, the replays of a
    graph), with other lengths, batches and split counts (3: not a power of two): each launch
    merges right and leaves the tickets zero (``run_decode`` checks)."""
    tickets = torch.zeros(16, dtype=torch.int32, device=DEVICE)  # more than any launch needs
    for kv_lens, splits in [([0, 37, 130], 4), ([130, 5], 16), ([200], 3), ([90, 1, 64, 0], 2)]:
        out, ref = run_decode(
            kv_lens, 8, 2, 16, 11, splits, torch.float32, sinks=True, tickets=tickets
        )
        assert_close(out, ref, 1e-4)


def decode_step(
    kv_lens: list[int], tables: torch.Tensor, block_size: int, window: int | None = None
) -> SequenceMetadata:
    """Step metadata of one new token per request over the given (already filled) tables,
    laid out for ``window``."""
    n = len(kv_lens)
    tables, starts = window_rows(tables, kv_lens, [1] * n, window, block_size)
    step = StepBatch(n, n, n, block_size, [paged_layout(n, n, tables.shape[1])])
    step.query_lens[:] = 1
    step.kv_lens[:] = kv_lens
    step.positions[:] = [length - 1 for length in kv_lens]
    step.group_parts[0]["block_tables"][:] = tables.cpu().numpy()
    step.group_parts[0]["table_starts"][:] = starts.cpu().numpy()
    step.logits_indices[:] = range(n)
    step.finish()
    return SequenceMetadata.from_step_batch(step, DEVICE)


def test_builder_workspace_tickets():
    """Graph buffers own zeroed tickets for the largest batch and ``graph_view`` hands each batch
    views of them (and of the partials); eager steps use builder-owned zeroed tickets. Launches
    through either leave them zero, so one buffer serves every layer and replay."""
    heads, kv_heads, block_size, window = 4, 1, 16, 100
    spec = AttentionSpec(heads, kv_heads, HEAD_DIM, HEAD_DIM**-0.5, window)
    builder = TritonAttentionBuilder(spec, block_size, max_model_len=512)
    buffers = builder.make_graph_buffers(8, DEVICE)
    assert buffers.tickets.dtype == torch.int32
    assert buffers.tickets.shape == (max(tickets_needed(b, kv_heads, 4) for b in range(1, 9)),)
    assert not buffers.tickets.any()

    kv_lens = [300, 5, 129]
    cache, tables, ks, vs = make_paged_cache(kv_lens, block_size, kv_heads, HEAD_DIM,
                                             torch.float32, DEVICE)  # fmt: skip
    q = strided_q(8, heads, HEAD_DIM, torch.float32, DEVICE, seed=4)
    steps = [(decode_step(kv_lens[:n], tables[:n], block_size, window), n) for n in (3, 1)]
    views = [builder.build(seq) for seq, _ in steps]
    for seq, n in steps:
        for batch in (n, 4, 8):
            builder.fill(seq, buffers, batch)
            views.append(builder.graph_view(seq, buffers, batch))
    assert any(v.workspace.num_splits > 1 for v in views)
    for view in views:
        n, ws = view.num_reqs, view.workspace
        if ws.num_splits > 1:
            assert ws.tickets.shape == (tickets_needed(n, kv_heads, ws.num_splits),)
            assert not ws.tickets.any()
            assert ws.partial_out.shape == (n, heads, ws.num_splits, HEAD_DIM)
        out = torch.full((n, heads, HEAD_DIM), float("nan"), device=DEVICE)
        paged_decode_attention(
            q[:n], cache, view.block_tables, view.table_starts, view.kv_lens, spec.scale, window,
            out, ws.num_splits, ws.partial_out, ws.partial_lse, ws.tickets,
        )  # fmt: skip
        real = int((view.kv_lens > 0).sum())
        assert_close(out[:real], decode_reference(q[:real], ks, vs, window, spec.scale), 1e-4)
        assert not out[real:].any(), "padded rows attend to nothing"
        assert ws.tickets is None or not ws.tickets.any()
    graph_ws = [v.workspace for v in views[2:] if v.workspace.num_splits > 1]
    for ws in graph_ws:
        assert ws.tickets.data_ptr() == buffers.tickets.data_ptr()
        assert ws.partial_out.data_ptr() == buffers.partial_out.data_ptr()


def test_decode_sinks_with_empty_splits_fp16():
    # 16 splits over at most 3 tiles: empty splits weigh nothing, the sink still counts once.
    out, ref = run_decode(
        [5, 150, 64, 0], 8, 2, 16, None, 16, torch.float16, softcap=1.5, sinks=True
    )
    assert_close(out, ref, 2e-3)


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("window", [None, 11])
def test_extend_softcap_and_sinks(feature, window):
    # A long prefill over history, a fresh prefill and a decode-like row.
    out, ref = run_extend(
        [150, 40, 75], [80, 40, 1], 4, 2, 16, window, torch.float32, **FEATURES[feature]
    )
    assert_close(out, ref, 1e-4)


def test_extend_softcap_and_sinks_fp16():
    out, ref = run_extend([100, 30], [70, 30], 4, 2, 32, 19, torch.float16, softcap=1.5, sinks=True)
    assert_close(out, ref, 2e-3)


@pytest.mark.parametrize("feature", list(FEATURES))
def test_softcap_and_sinks_change_the_result(feature):
    """Guard against vacuous tests: each feature moves the output well beyond the tolerance."""
    plain, _ = run_decode([37, 130], 8, 2, 16, None, 1, torch.float32)
    out, ref = run_decode([37, 130], 8, 2, 16, None, 1, torch.float32, **FEATURES[feature])
    assert_close(out, ref, 1e-4)
    assert (out - plain).abs().max() > 0.05


# ----------------------------------------------------------------------------- GPU, bf16

CUDA = torch.device("cuda")
GPU_TOL = 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("window", [None, 500])
def test_gpu_decode_bf16(block_size, window):
    gen = torch.Generator().manual_seed(block_size)
    kv_lens = torch.randint(1, 2049, (64,), generator=gen).tolist()
    kv_lens[3] = 0  # a padded row
    kv_lens[5] = 2048
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    for batch, splits in [(64, choose_num_splits(64, 8, 2048, num_sms)), (4, 8)]:
        out, ref = run_decode(
            kv_lens[:batch], 16, 8, block_size, window, splits, torch.bfloat16, 128,
            device=CUDA,
        )  # fmt: skip
        assert_close(out, ref, GPU_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 64])
def test_gpu_extend_bf16(block_size):
    q_lens = [512, 1024, 700, 1]
    kv_lens = [512, 1024 + 300, 700 + 1000, 900]  # fresh prefill, prefix hits, a decode row
    out, ref = run_extend(
        kv_lens, q_lens, 16, 8, block_size, None, torch.bfloat16, 128, device=CUDA
    )
    assert_close(out, ref, GPU_TOL)
    out, ref = run_extend(kv_lens, q_lens, 16, 8, block_size, 256, torch.bfloat16, 128, device=CUDA)
    assert_close(out, ref, GPU_TOL)


# Model-shaped layers with the features their models use (scale head_dim ** -0.5 as in
# Gemma 2's query_pre_attn_scalar = 256; random scores are about N(0, 1), so Gemma 2's real cap
# of 50 barely bites and a cap of 2 does):
# (heads, kv_heads, head_dim, window, softcap, sinks)
GPU_FEATURE_CASES = [
    pytest.param(8, 4, 256, None, 50.0, False, id="gemma2-2b-global"),
    pytest.param(8, 4, 256, 512, 2.0, False, id="gemma2-2b-local-cap2"),
    pytest.param(4, 1, 256, 512, 2.0, True, id="gemma3-1b-shape-local-cap2-sinks"),
    pytest.param(64, 8, 64, None, None, True, id="gpt-oss-global"),
    pytest.param(64, 8, 64, 128, None, True, id="gpt-oss-local"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("heads, kv_heads, head_dim, window, softcap, sinks", GPU_FEATURE_CASES)
def test_gpu_decode_softcap_and_sinks_bf16(heads, kv_heads, head_dim, window, softcap, sinks):
    """The engine's split count for a full batch and for one request (one-tile splits), a
    forced multi-split and a single split."""
    gen = torch.Generator().manual_seed(head_dim + heads)
    kv_lens = torch.randint(1, 4097, (64,), generator=gen).tolist()
    kv_lens[1] = 0  # a padded row
    kv_lens[2] = 4096
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    engine_splits = [choose_num_splits(b, kv_heads, 4096, num_sms, window) for b in (64, 1)]
    for lens, splits in [
        (kv_lens, engine_splits[0]),
        (kv_lens[2:3], engine_splits[1]),
        (kv_lens[:4], 8),
        (kv_lens[:3], 1),
    ]:
        out, ref = run_decode(
            lens, heads, kv_heads, 16, window, splits, torch.bfloat16, head_dim,
            device=CUDA, softcap=softcap, sinks=sinks, workspace=True,
        )  # fmt: skip
        assert_close(out, ref, GPU_TOL)
        assert (out[torch.tensor(lens, device=CUDA) == 0] == 0).all(), "padded rows are zero"


@pytest.mark.gpu
@pytest.mark.parametrize("heads, kv_heads, head_dim, window, softcap, sinks", GPU_FEATURE_CASES)
def test_gpu_extend_softcap_and_sinks_bf16(heads, kv_heads, head_dim, window, softcap, sinks):
    q_lens = [512, 1024, 700, 1]
    kv_lens = [512, 1024 + 300, 700 + 3000, 900]  # fresh prefill, prefix hits, a decode row
    out, ref = run_extend(
        kv_lens, q_lens, heads, kv_heads, 16, window, torch.bfloat16, head_dim, device=CUDA,
        softcap=softcap, sinks=sinks,
    )  # fmt: skip
    assert_close(out, ref, GPU_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("features", [False, True], ids=["plain", "softcap+sinks"])
def test_gpu_decode_cuda_graph_replay(features):
    """Captured once, replayed with new lengths and tables: same as an eager call."""
    batch, heads, kv_heads, dim, block_size, splits = 8, 16, 8, 128, 16, 4
    cache, tables, _, _ = make_paged_cache(
        [2048] * batch, block_size, kv_heads, dim, torch.bfloat16, CUDA
    )
    q = torch.randn(batch, heads, dim, dtype=torch.bfloat16, device=CUDA)
    out = torch.empty_like(q)
    lens = torch.full((batch,), 2048, dtype=torch.int32, device=CUDA)
    static_tables = tables.clone()
    static_starts = torch.zeros(batch, dtype=torch.int32, device=CUDA)
    ws = dict(
        partial_out=torch.empty(batch, heads, splits, dim, device=CUDA),
        partial_lse=torch.empty(batch, heads, splits, device=CUDA),
        tickets=torch.zeros(
            tickets_needed(batch, kv_heads, splits), dtype=torch.int32, device=CUDA
        ),
    )

    extra = {}
    if features:
        extra = dict(softcap=2.0, sinks=make_sinks(heads, torch.bfloat16, CUDA))

    def step():
        paged_decode_attention(
            q, cache, static_tables, static_starts, lens, 0.088, None, out, splits, **ws, **extra
        )

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    gen = torch.Generator().manual_seed(7)
    for _ in range(3):
        lens.copy_(torch.randint(0, 2049, (batch,), generator=gen))
        perm = torch.randperm(batch, generator=gen).to(CUDA)
        static_tables.copy_(tables[perm])
        graph.replay()
        replayed = out.clone()
        eager = torch.empty_like(q)
        paged_decode_attention(
            q, cache, static_tables, static_starts, lens, 0.088, None, eager, splits, **extra
        )
        # Bitwise equal although the splits finish in another order: the merge is ordered.
        torch.testing.assert_close(replayed, eager, atol=0, rtol=0)
        assert not replayed.isnan().any()
        assert not ws["tickets"].any(), "each replay leaves its tickets zero"


# Real layer shapes (heads, KV heads, head_dim): Gemma-3-1B, Qwen3-0.6B, gpt-oss-like; and the
# features (window, soft-cap, sinks) each alone, for the lowering test.
LAYER_SHAPES = [(4, 1, 256), (16, 8, 128), (64, 8, 64)]
FEATURE_SETS = [(None, None, False), (512, None, False), (None, 50.0, False), (128, None, True)]


def attention_launches() -> None:
    """bf16 decode (one and several splits; a uniform step's tokens as rows) and extend
    (also over a mixed step's sliced per-request tensors) launches of every layer shape with
    every feature set."""
    bf16 = torch.bfloat16
    for (heads, kv_heads, head_dim), (window, softcap, sinks) in itertools.product(
        LAYER_SHAPES, FEATURE_SETS
    ):
        cache = torch.empty(2, 8, 16, kv_heads, head_dim, dtype=bf16)
        tables = torch.zeros(2, 4, dtype=torch.int32)
        table_starts = torch.zeros(2, dtype=torch.int32)
        lens = torch.ones(2, dtype=torch.int32)
        features = dict(softcap=softcap, sinks=torch.empty(heads, dtype=bf16) if sinks else None)
        q = torch.empty(2, heads, head_dim, dtype=bf16)
        for splits in (1, 16, 128):
            paged_decode_attention(
                q, cache, tables, table_starts, lens, 0.1, window, torch.empty_like(q), splits,
                **features,
            )  # fmt: skip
        block = torch.empty(4, heads, head_dim, dtype=bf16)  # two tokens of each of two rows
        paged_decode_attention(
            block, cache, tables, table_starts, lens, 0.1, window, torch.empty_like(block), 16,
            **features, queries_per_row=2,
        )  # fmt: skip
        starts = torch.tensor([0, 1, 2], dtype=torch.int32)
        paged_extend_attention(
            q, cache, tables, table_starts, starts, lens, 1, 0.1, window, torch.empty_like(q),
            **features,
        )  # fmt: skip
        # A mixed step's extend launch: its per-request tensors start past a decode row, off
        # the 16-byte alignment the launcher specialises on.
        wide = torch.zeros(3, 5, dtype=torch.int32)
        three = torch.ones(3, dtype=torch.int32)
        paged_extend_attention(
            q, cache, wide[1:], three[1:], torch.arange(4, dtype=torch.int32)[1:], three[1:],
            1, 0.1, window, torch.empty_like(q), **features,
        )  # fmt: skip


def test_attention_launches_lower_for_hopper():
    """Triton's compiler accepts the decode and extend kernels' launch variants for real layer
    shapes (which the interpreter alone would not prove)."""
    assert check_lowering(
        "ops.test_triton_attention_kernels:attention_launches",
        "heron.kernels.attention_decode:_decode_kernel",
        "heron.kernels.attention_extend:_extend_kernel",
    )
