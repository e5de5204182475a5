"""StepMetaPlan: grouping by builder key, bind-after-validate, coverage, fallback, views."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from heron.cache.paged_parts import paged_layout
from heron.metadata import (
    GraphSupport,
    MetadataBuilder,
    MetadataOperator,
    ModelBuildContext,
    SequenceMetadata,
    StepBatch,
    StepMetadataError,
    StepMetaPlan,
)
from heron.ops.attention.base import AttentionSpec
from heron.ops.attention.paged import PagedAttentionBuilder, PagedAttentionView
from heron.ops.attention.reference import ReferenceAttention

from tiny_models import attend

MAX_MODEL_LEN = 64


class CountingBuilder(MetadataBuilder):
    """A builder with a chosen key and graph support that counts its ``build`` calls."""

    def __init__(self, key, graph_support: GraphSupport = GraphSupport.ALWAYS) -> None:
        self._key = key
        self.graph_support = graph_support
        self.builds = 0

    @property
    def key(self):
        return self._key

    def build(self, seq):
        self.builds += 1
        return ("view", self._key, self.builds)


class KeyedOp(MetadataOperator):
    """An operator whose builder has the given key (or whose metadata_builder returns ``ret``)."""

    _unset = object()

    def __init__(self, name, key=None, support=GraphSupport.ALWAYS, ret=_unset) -> None:
        super().__init__(name)
        self._builder = CountingBuilder(key, support) if ret is KeyedOp._unset else ret

    def metadata_builder(self):
        return self._builder


class LegacyOp(MetadataOperator):
    """An operator not yet ported: it has no metadata builder (the base class default)."""


def spec(window: int | None = None, heads: tuple[int, int] = (4, 2)) -> AttentionSpec:
    return AttentionSpec(heads[0], heads[1], 16, 16**-0.5, window)


def attention(name: str, window: int | None = None, block_size: int = 16) -> ReferenceAttention:
    return ReferenceAttention(name, spec(window), block_size, MAX_MODEL_LEN)


def fallback_builder() -> PagedAttentionBuilder:
    return PagedAttentionBuilder("fallback", 16, None, MAX_MODEL_LEN)


# --------------------------------------------------------------------------- grouping


def test_equal_keys_share_one_group_and_builder():
    with ModelBuildContext() as scope:
        ops = [attention(f"layers.{i}.attn") for i in range(4)]
    plan = StepMetaPlan.from_operators(scope.operators)
    assert len(plan.groups) == 1
    (group,) = plan.groups
    assert all(op.group is group for op in ops)
    assert group.layers == [f"layers.{i}.attn" for i in range(4)]
    # One builder: the first operator's; the others' equal-keyed builders are not used.
    assert group.builder is ops[0].metadata_builder()
    assert not group.is_fallback and plan.fallback_reason is None


def test_dedupe_builds_each_group_once_per_step():
    with ModelBuildContext() as scope:
        ops = [KeyedOp(f"l{i}", key=("k", i % 2)) for i in range(6)]
    plan = StepMetaPlan.from_operators(scope.operators)
    assert len(plan.groups) == 2
    plan.build_views(seq=None)
    used = [g.builder for g in plan.groups]
    assert [b.builds for b in used] == [1, 1]
    # Builders of operators that joined an existing group are never called.
    assert all(op.metadata_builder().builds == 0 for op in ops[2:])
    # Operators read their group's view.
    assert [op.view for op in ops] == [("view", ("k", i % 2), 1) for i in range(6)]


def test_different_windows_and_block_sizes_get_different_groups():
    with ModelBuildContext() as scope:
        attention("layers.0.attn", window=None)
        attention("layers.1.attn", window=8)
        attention("layers.2.attn", window=None)
        attention("layers.3.attn", window=8, block_size=32)
        attention("layers.4.attn", window=8)
        attention("layers.5.attn", window=4)
    plan = StepMetaPlan.from_operators(scope.operators)
    assert [g.layers for g in plan.groups] == [
        ["layers.0.attn", "layers.2.attn"],
        ["layers.1.attn", "layers.4.attn"],
        ["layers.3.attn"],
        ["layers.5.attn"],
    ]
    assert [g.group_id for g in plan.groups] == [0, 1, 2, 3]
    keys = [g.builder.key for g in plan.groups]
    assert len(set(keys)) == 4
    assert [(g.builder.block_size, g.builder.sliding_window) for g in plan.groups] == [
        (16, None),
        (16, 8),
        (32, 8),
        (16, 4),
    ]


# --------------------------------------------------------------------------- bind after validate


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(lambda: KeyedOp("bad", key=["unhashable", "list"]), id="unhashable-key"),
        pytest.param(lambda: KeyedOp("bad", ret={"not": "a builder"}), id="not-a-builder"),
        pytest.param(lambda: KeyedOp("layers.0", key="dup"), id="duplicate-layer"),
    ],
)
def test_nothing_is_bound_unless_the_whole_set_validates(bad):
    with ModelBuildContext() as scope:
        before = [KeyedOp("layers.0", key="a"), KeyedOp("layers.1", key="b"), LegacyOp("legacy")]
        bad_op = bad()
        after = [KeyedOp("layers.2", key="a")]
    with pytest.raises(StepMetadataError, match="bad|layers.0"):
        StepMetaPlan.from_operators(scope.operators, fallback_builder)
    for op in [*before, bad_op, *after]:
        assert op.group is None, op.layer_name
        with pytest.raises(StepMetadataError, match=op.layer_name):
            op.view  # noqa: B018


def test_orphans_without_fallback_raise_naming_them_and_bind_nothing():
    with ModelBuildContext() as scope:
        good = KeyedOp("layers.0", key="a")
        legacy = [LegacyOp("layers.1.legacy"), LegacyOp("layers.2.legacy")]
    with pytest.raises(StepMetadataError, match=r"layers\.1\.legacy, layers\.2\.legacy"):
        StepMetaPlan.from_operators(scope.operators)
    assert good.group is None and all(op.group is None for op in legacy)


# --------------------------------------------------------------------------- coverage


def test_check_coverage_names_the_operator_left_out():
    with ModelBuildContext() as scope:
        model = nn.ModuleList(attention(f"layers.{i}.attn") for i in range(3))
    plan = StepMetaPlan.from_operators(scope.operators)
    plan.check_coverage(model)  # complete: passes

    partial = StepMetaPlan.from_operators(
        [op for op in scope.operators if op.layer_name != "layers.1.attn"]
    )
    # layers.1 is still bound to the first plan, which is not this one.
    with pytest.raises(StepMetadataError, match=r"layers\.1\.attn.*ReferenceAttention"):
        partial.check_coverage(model)


def test_check_coverage_catches_operator_added_after_planning():
    with ModelBuildContext() as scope:
        model = nn.ModuleList(attention(f"layers.{i}.attn") for i in range(2))
    plan = StepMetaPlan.from_operators(scope.operators)
    with ModelBuildContext():
        model.append(attention("layers.9.attn"))
    assert model[2].group is None
    with pytest.raises(StepMetadataError, match=r"layers\.9\.attn"):
        plan.check_coverage(model)


# --------------------------------------------------------------------------- fallback


def test_operators_without_builder_run_on_the_fallback_group():
    with ModelBuildContext() as scope:
        a0 = attention("layers.0.attn")
        legacy = LegacyOp("layers.1.legacy")
        a2 = attention("layers.2.attn", window=8)
        legacy3 = LegacyOp("layers.3.legacy")
    plan = StepMetaPlan.from_operators(scope.operators, fallback_builder)
    assert len(plan.groups) == 3
    fallback = plan.groups[-1]
    assert fallback.is_fallback and fallback.builder.backend == "fallback"
    assert fallback.layers == ["layers.1.legacy", "layers.3.legacy"]
    assert legacy.group is fallback and legacy3.group is fallback
    assert a0.group is plan.groups[0] and a2.group is plan.groups[1]
    assert not a0.group.is_fallback and not a2.group.is_fallback
    assert "LegacyOp" in plan.fallback_reason and "2 operator" in plan.fallback_reason
    assert plan.describe()["fallback_reason"] == plan.fallback_reason
    assert [g["fallback"] for g in plan.describe()["groups"]] == [False, False, True]


def test_no_fallback_reason_when_every_operator_has_a_builder():
    with ModelBuildContext() as scope:
        attention("layers.0.attn")
    plan = StepMetaPlan.from_operators(scope.operators, fallback_builder)
    assert plan.fallback_reason is None
    assert not any(g.is_fallback for g in plan.groups)


def test_forced_fallback_puts_every_operator_in_one_group():
    with ModelBuildContext() as scope:
        ops = [attention("layers.0.attn"), attention("layers.1.attn", window=8)]
    plan = StepMetaPlan.from_operators(
        scope.operators, fallback_builder, fallback_reason="platform 'x' does not collect"
    )
    assert len(plan.groups) == 1 and plan.groups[0].is_fallback
    assert all(op.group is plan.groups[0] for op in ops)
    assert plan.fallback_reason == "platform 'x' does not collect"


# ------------------------------------------------------------------ graph support, describe


def test_graph_support_is_the_weakest_group():
    with ModelBuildContext() as scope:
        KeyedOp("a", key=1, support=GraphSupport.ALWAYS)
        KeyedOp("b", key=2, support=GraphSupport.UNIFORM)
        KeyedOp("c", key=3, support=GraphSupport.DECODE_ONLY)
        KeyedOp("d", key=1, support=GraphSupport.NEVER)  # joins group of "a": not counted
    plan = StepMetaPlan.from_operators(scope.operators)
    assert plan.graph_support is GraphSupport.DECODE_ONLY
    with ModelBuildContext() as scope:
        KeyedOp("a", key=1, support=GraphSupport.ALWAYS)
        KeyedOp("e", key=5, support=GraphSupport.NEVER)
    assert StepMetaPlan.from_operators(scope.operators).graph_support is GraphSupport.NEVER
    assert StepMetaPlan([]).graph_support is GraphSupport.NEVER
    assert GraphSupport.NEVER < GraphSupport.DECODE_ONLY < GraphSupport.UNIFORM
    assert GraphSupport.UNIFORM < GraphSupport.ALWAYS


def test_describe_lists_groups_builders_keys_layers_and_graph_support():
    with ModelBuildContext() as scope:
        attention("layers.0.attn")
        attention("layers.1.attn", window=8)
        attention("layers.2.attn")
    desc = StepMetaPlan.from_operators(scope.operators).describe()
    assert set(desc) == {"groups", "fallback_reason"}
    assert desc["fallback_reason"] is None
    g0, g1 = desc["groups"]
    for g in (g0, g1):
        assert {"group", "builder", "key", "layers", "graph_support"} <= set(g)
        assert g["builder"] == "PagedAttentionBuilder(reference)"
        assert g["graph_support"] == "DECODE_ONLY"
    assert (g0["group"], g1["group"]) == (0, 1)
    assert g0["layers"] == ["layers.0.attn", "layers.2.attn"]
    assert g1["layers"] == ["layers.1.attn"]
    assert g0["key"] == ["PagedAttentionBuilder", "reference", 16, None, 4]
    assert g1["key"] == ["PagedAttentionBuilder", "reference", 16, 8, 4]
    assert json.loads(json.dumps(desc)) == desc


# --------------------------------------------------------------------------- views per group


def _dense(q, k, v, q_start, window, scale):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    q_pos = torch.arange(q_start, q_start + q.shape[0])[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    mask = (k_pos <= q_pos) & ((q_pos - k_pos < window) if window else True)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)


def test_each_operator_reads_its_own_groups_view():
    """Two attention layers with different windows form two groups over one shuffled paged
    cache layout. With the plan's views each matches its dense reference; with the two groups'
    views swapped, each layer attends with the other's window and the outputs break."""
    bs, num_blocks, windows = 4, 32, (None, 3)
    gen = torch.Generator().manual_seed(0)
    with ModelBuildContext() as scope:
        ops = [
            ReferenceAttention(f"layers.{i}.attn", spec(w), bs, MAX_MODEL_LEN)
            for i, w in enumerate(windows)
        ]
    plan = StepMetaPlan.from_operators(scope.operators)
    assert len(plan.groups) == 2 and ops[0].group is not ops[1].group
    for op in ops:
        op.bind_cache(torch.zeros(2, num_blocks, bs, 2, 16))
    # One KV cache group per window, as the runner assigns them: the windowed group's rows
    # start at the window, over the same physical blocks here.
    ops[1].group.builder.cache_group = 1
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = {"a": [free.pop() for _ in range(4)], "b": [free.pop() for _ in range(4)]}

    def make_seq(work):  # (request, cached tokens, new tokens)
        num_reqs, num_tokens = len(work), sum(n for _, _, n in work)
        layout = paged_layout(num_reqs, num_tokens, 4)
        batch = StepBatch(num_reqs, num_tokens, num_reqs, bs, [layout, layout])
        offset = 0
        for i, (rid, c, n) in enumerate(work):
            batch.query_lens[i], batch.kv_lens[i] = n, c + n
            pos = list(range(c, c + n))
            batch.positions[offset : offset + n] = pos
            for parts, window in zip(batch.group_parts, windows):
                first = 0 if window is None else max(c - window + 1, 0) // bs
                parts["block_tables"][i, : len(tables[rid]) - first] = tables[rid][first:]
                parts["table_starts"][i] = first
                parts["slot_mapping"][offset : offset + n] = [
                    tables[rid][p // bs] * bs + p % bs for p in pos
                ]
            offset += n
            batch.logits_indices[i] = offset - 1
        batch.finish()
        return SequenceMetadata.from_step_batch(batch, torch.device("cpu"))

    def run_and_check(work, expect_match):
        """Run every layer on fresh q/k/v; return whether each output matched its reference."""
        matched = []
        n = sum(w[2] for w in work)
        for op, window in zip(ops, windows):
            q, k, v = torch.randn(n, 4, 16, generator=gen), *torch.randn(2, n, 2, 16, generator=gen)
            out = attend(op, q, k, v)
            cache = op.kv_cache
            ok, offset = True, 0
            for rid, c, m in work:
                pos = torch.arange(c + m)
                blocks = torch.tensor(tables[rid])[pos // bs]
                k_all, v_all = cache[0, blocks, pos % bs], cache[1, blocks, pos % bs]
                # The new K/V landed at the step's slots.
                assert torch.equal(k_all[c:], k[offset : offset + m])
                ref = _dense(q[offset : offset + m], k_all, v_all, c, window, op.spec.scale)
                ok &= torch.allclose(out[offset : offset + m], ref, atol=1e-5, rtol=1e-5)
                offset += m
            matched.append(ok)
        if expect_match:
            assert matched == [True, True]
        return matched

    # Prefill both requests (longer than the window), then an extend step and a decode step.
    steps = [
        [("a", 0, 13), ("b", 0, 9)],
        [("a", 13, 2), ("b", 9, 3)],
        [("a", 15, 1), ("b", 12, 1)],
    ]
    for work in steps:
        plan.build_views(make_seq(work))
        assert isinstance(ops[0].view, PagedAttentionView)
        assert (ops[0].view.sliding_window, ops[1].view.sliding_window) == windows
        run_and_check(work, expect_match=True)

        # Same step, views swapped between the two groups: each layer now reads the other's.
        g0, g1 = plan.groups
        g0.view, g1.view = g1.view, g0.view
        assert ops[0].view.sliding_window == windows[1]
        matched = run_and_check(work, expect_match=False)
        assert matched != [True, True], "swapping the groups' views changed nothing"
