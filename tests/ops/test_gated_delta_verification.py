"""Uniform verification steps of the gated-delta-rule operator on Heron's Triton decode kernels
(interpreted, fp32): ``q`` tokens per row as ``q`` decode steps in the row's slot, the states
after each token but the last kept in the reserved buffers. Against the PyTorch operator
decoding the same tokens one step at a time: outputs, the slot's final states, every kept
state, and the rollback to an accepted token's state; eagerly and through graph buffers padded
onto the null slot (other slots untouched). On the GPU, a captured verification graph replayed
on a real step equals eager, and its warm-up and capture touch the null slot only."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from ops.test_gated_delta_builder import step

from heron.layers.norm import GatedRMSNorm
from heron.metadata import GraphSupport, ModelBuildContext, StepMetadataError, StepMetaPlan
from heron.ops.linear_attention import triton_operator
from heron.ops.linear_attention.operator import GatedDeltaNet, GatedDeltaNetSpec
from heron.ops.linear_attention.triton_operator import TritonGatedDeltaNet

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")

SPEC = GatedDeltaNetSpec(num_key_heads=2, num_value_heads=4, key_dim=8, value_dim=6, conv_kernel=4)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CONTEXTS, SLOTS, Q = [5, 9, 2], [3, 1, 4], 3  # slots 2 and 5 belong to nobody this step


def operators(reserve: bool = True):
    """The PyTorch and the Triton operator, one plan, each with its own copy of one random
    state cache (6 slots) and, with ``reserve``, verification buffers for 4 rows."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(SPEC.conv_dim, 1, SPEC.conv_kernel, generator=gen) * 0.5
    A_log, dt_bias = torch.rand(4, generator=gen).log(), torch.randn(4, generator=gen)
    weight, A_log, dt_bias = (t.to(DEVICE) for t in (weight, A_log, dt_bias))
    with ModelBuildContext() as scope:
        ref = GatedDeltaNet("ref", SPEC, weight, A_log, dt_bias)
        tri = TritonGatedDeltaNet("tri", SPEC, weight, A_log, dt_bias)
    StepMetaPlan.from_operators(scope.operators)
    conv, state = ref.cache_spec.allocate(6, torch.device("cpu"))
    conv.normal_(generator=gen)
    state.normal_(generator=gen)
    for op in (ref, tri):
        op.metadata_builder().cache_group = 1  # the step's recurrent group
        op.bind_cache((conv.to(DEVICE, copy=True), state.to(DEVICE, copy=True)))
        if reserve:
            op.reserve_verification(4, Q - 1, DEVICE)
    return ref, tri


def inputs(rows: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(rows * Q, width, generator=gen).to(DEVICE) for width in (SPEC.conv_dim, 4, 4)
    )


def verification_step(contexts=CONTEXTS, slots=SLOTS):
    seq = step(contexts, [Q] * len(contexts), slots)
    seq = replace(seq, num_proposed_host=np.full(len(contexts), Q - 1))
    return on_device(seq)


def on_device(seq):
    """The step with its device tensors on ``DEVICE`` (the builder test's step is the CPU's)."""
    if DEVICE.type == "cpu":
        return seq
    moved = {
        name: getattr(seq, name).to(DEVICE)
        for name in ("token_ids", "positions", "kv_lens", "query_start_loc", "logits_indices")
    }
    parts = tuple(
        replace(p, **{f: getattr(p, f).to(DEVICE) for f in p.__dataclass_fields__})
        for p in seq.group_parts
    )
    return replace(seq, **moved, group_parts=parts)


def decode_one_by_one(ref: GatedDeltaNet, x, a, b):
    """The PyTorch operator's decode steps over the rows' tokens in order: the outputs
    ``[rows, Q, heads, value_dim]`` and the slots' states after each token."""
    outs, states = [], []
    for t in range(Q):
        ref.group.view = ref.metadata_builder().build(
            on_device(step([c + t for c in CONTEXTS], [1] * 3, SLOTS))
        )
        outs.append(ref(x[t::Q], a[t::Q], b[t::Q]))
        slots = torch.tensor(SLOTS, device=DEVICE)
        states.append((ref.conv_state[slots].clone(), ref.recurrent_state[slots].clone()))
    return torch.stack(outs, 1), states


def gated_norm(rows: int):
    """The layer's gated norm (random weight) and a gate ``z`` for ``rows`` rows of Q tokens."""
    gen = torch.Generator().manual_seed(2)
    norm = GatedRMSNorm(SPEC.value_dim)
    norm.weight.data.normal_(generator=gen)
    norm = norm.to(DEVICE)
    gate = torch.randn(rows * Q, SPEC.num_value_heads * SPEC.value_dim, generator=gen)
    return gate.to(DEVICE), norm


def test_verification_equals_decoding_token_by_token_and_rolls_back():
    ref, tri = operators()
    assert tri.metadata_builder().graph_support is GraphSupport.UNIFORM
    assert ref.metadata_builder().graph_support is GraphSupport.DECODE_ONLY
    x, a, b = inputs(3)
    want, states = decode_one_by_one(ref, x, a, b)
    tri.group.view = tri.metadata_builder().build(verification_step())
    assert tri.view.verifies_uniformly
    got = tri(x, a, b).view(3, Q, 4, SPEC.value_dim)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    slots = torch.tensor(SLOTS, device=DEVICE)
    torch.testing.assert_close(tri.conv_state[slots], states[-1][0])
    torch.testing.assert_close(tri.recurrent_state[slots], states[-1][1])
    for t in range(Q - 1):
        torch.testing.assert_close(tri._verified_conv[:3, t], states[t][0])
        torch.testing.assert_close(tri._verified_states[:3, t], states[t][1], rtol=1e-5, atol=1e-5)
    # Row 0 accepted no proposal, row 2 one: their slots go back to those tokens' states.
    copies = tri.verified_state_copies(SLOTS[0], 0, 0) + tri.verified_state_copies(SLOTS[2], 2, 1)
    torch._foreach_copy_(*map(list, zip(*copies)))
    torch.testing.assert_close(tri.recurrent_state[3], states[0][1][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tri.recurrent_state[4], states[1][1][2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tri.conv_state[4], states[1][0][2])


@pytest.mark.parametrize("normed, fused", [(False, False), (True, False), (True, True)])
def test_graph_buffers_pad_onto_the_null_slot_and_leave_other_slots_alone(
    normed, fused, monkeypatch
):
    """The two decode kernels, then (given the layer's norm) the norm's, or with the switch on
    the one fused launch: the norm of the same outputs."""
    monkeypatch.setattr(triton_operator, "FUSED_DECODE", fused)
    monkeypatch.setattr(triton_operator, "FUSED_MAX_VALUE_HEADS_PER_KEY", 2)  # SPEC's
    ref, tri = operators()
    assert tri._fuses_norm == fused
    x, a, b = inputs(4)
    gate, norm = gated_norm(4) if normed else (None, None)
    real = slice(0, 3 * Q)
    want, _ = decode_one_by_one(ref, x[real], a[real], b[real])
    if normed:
        want = norm(want.flatten(0, 1), gate[real].view(3 * Q, 4, -1)).view(want.shape)
    builder = tri.metadata_builder()
    buffers = builder.make_graph_buffers(4, DEVICE, max_query_len=Q)
    seq = verification_step()
    builder.fill(seq, buffers, 4)
    tri.group.view = builder.graph_view(seq, buffers, 4)
    assert tri.view.verifies_uniformly and tri.view.num_reqs == 4
    assert tri.view.query_start_loc.tolist() == [0, 3, 6, 9, 12]
    untouched = [2, 5]
    before = tri.recurrent_state[untouched].clone(), tri.conv_state[untouched].clone()
    got = tri(x, a, b, gate, norm).view(4, Q, 4, SPEC.value_dim)
    torch.testing.assert_close(got[:3], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(tri.recurrent_state[untouched], before[0])
    assert torch.equal(tri.conv_state[untouched], before[1])
    with pytest.raises(StepMetadataError, match="uniform verification"):
        builder.fill(on_device(step(CONTEXTS, [1, 2, 3], SLOTS)), buffers, 4)


def test_a_verification_step_needs_reserved_buffers():
    _, tri = operators(reserve=False)
    tri.group.view = tri.metadata_builder().build(verification_step())
    with pytest.raises(StepMetadataError, match="reserve_verification"):
        tri(*inputs(3))


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True])
def test_replayed_verification_graph_equals_eager(fused, monkeypatch):
    """The two decode kernels, or (given the layer's norm) the fused launch."""
    monkeypatch.setattr(triton_operator, "FUSED_MAX_VALUE_HEADS_PER_KEY", 2)  # SPEC's
    _, eager = operators()
    _, graphed = operators()
    assert graphed._fuses_norm
    x, a, b = inputs(4)
    gate, norm = gated_norm(4) if fused else (None, None)
    real = slice(0, 3 * Q)
    eager.group.view = eager.metadata_builder().build(verification_step())
    want = eager(x[real], a[real], b[real], None if gate is None else gate[real], norm)

    builder = graphed.metadata_builder()
    buffers = builder.make_graph_buffers(4, DEVICE, max_query_len=Q)
    dummy = verification_step([0] * 4, [0] * 4)  # every row on the null slot, no state
    builder.fill(dummy, buffers, 4)
    graphed.group.view = builder.graph_view(dummy, buffers, 4)
    held = graphed.conv_state[1:].clone(), graphed.recurrent_state[1:].clone()
    graphed(x, a, b, gate, norm)  # warm-up
    builder.before_capture(buffers)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = graphed(x, a, b, gate, norm)
    torch.cuda.synchronize()
    assert torch.equal(graphed.conv_state[1:], held[0])
    assert torch.equal(graphed.recurrent_state[1:], held[1])
    builder.fill(verification_step(), buffers, 4)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured[real], want, rtol=1e-5, atol=1e-5)
    slots = torch.tensor(SLOTS, device=DEVICE)
    for mine, theirs in (
        (graphed.recurrent_state[slots], eager.recurrent_state[slots]),
        (graphed._verified_states[:3], eager._verified_states[:3]),
        (graphed._verified_conv[:3], eager._verified_conv[:3]),
    ):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
