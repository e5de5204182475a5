"""The fused GDN decode kernel (conv update, delta rule, gated RMSNorm in one launch) against
the three unfused launches and against the fp32 PyTorch recurrence of ``reference.py`` with
HF's gated norm (Triton's interpreter on the CPU in fp32 and fp16; bf16 on the GPU): shuffled
slots, a padded row on the null slot, a new request whose slot is stale, NaN in every slot no
real state is read from, 1 and 2 value heads per key head, 1 and 3 tokens per row (the states
after each token but the last kept). Also its lowering for Hopper at the Qwen3.5 shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_lowering import check_lowering

from heron.kernels.gated_delta import gdn_decode
from heron.kernels.gated_delta_fused import fused_gdn_decode
from heron.kernels.rmsnorm import gated_rms_norm
from heron.layers.norm import GatedRMSNorm
from heron.ops.linear_attention.reference import causal_conv1d_step, gated_delta_step, prepare_qk

K, V, W, EPS = 8, 6, 4, 1e-6  # V is no power of two: masked value lanes
SLOTS = [4, 0, 1, 3]  # row 1 is a padded row on the null slot; slots 2 and 5 are nobody's
HAS_STATE = [True, False, False, True]  # row 2 is a new request: its slot holds stale NaN
READ = [3, 4]  # the slots whose states are read


def layer(
    hk: int, hv: int, q: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0, dims=(K, V)
):
    """Random inputs, weights and states (fp32 recurrent state) of one step of ``q`` tokens
    per row with head dims ``dims``, as a dict of the fused kernel's arguments."""
    K, V = dims
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)
    conv_dim, tokens = 2 * hk * K + hv * V, len(SLOTS) * q
    conv_state = torch.full((6, conv_dim, W - 1), float("nan"), dtype=dtype, device=device)
    state = torch.full((6, hv, K, V), float("nan"), device=device)
    conv_state[READ], state[READ] = rand(2, conv_dim, W - 1), rand(2, hv, K, V).float()
    kept = None
    if q > 1:
        kept = (
            torch.full((5, q - 1, conv_dim, W - 1), float("nan"), dtype=dtype, device=device),
            torch.full((5, q - 1, hv, K, V), float("nan"), device=device),
        )
    # a, b and z as the mixer hands them: column slices of one projection's output.
    zba = rand(tokens, hv * V + 2 * hv)
    return dict(
        x=rand(tokens, conv_dim),
        gate=zba[:, : hv * V],
        a=zba[:, hv * V : hv * V + hv],
        b=zba[:, hv * V + hv :],
        conv_weight=rand(conv_dim, W) * 0.5,
        A_log=torch.rand(hv, generator=gen).log().to(device),
        dt_bias=torch.randn(hv, generator=gen).to(device),
        norm_weight=rand(V) + 1,
        eps=EPS,
        conv_state=conv_state,
        state=state,
        slots=torch.tensor(SLOTS, dtype=torch.int32, device=device),
        has_state=torch.tensor(HAS_STATE, device=device),
        num_key_heads=hk,
        kept=kept,
    )


def unfused(args: dict) -> torch.Tensor:
    """The three launches of the unfused path, on ``args``' states in place."""
    rule = {k: v for k, v in args.items() if k not in ("gate", "norm_weight", "eps")}
    out = gdn_decode(**rule)
    return gated_rms_norm(out, args["gate"].view(out.shape), args["norm_weight"], EPS)


def reference(args: dict, q: int):
    """The fp32 recurrence of reference.py token by token and HF's gated norm: the outputs
    [rows * q, Hv, V] and, per real row, its conv and recurrent states after each token."""
    hk, x = args["num_key_heads"], args["x"].float()
    _, hv, K, V = args["state"].shape
    weight = args["conv_weight"].float()
    norm = GatedRMSNorm(V, EPS)
    norm.weight.data = args["norm_weight"].float().cpu()
    g = -args["A_log"].exp() * F.softplus(args["a"].float() + args["dt_bias"])
    beta = args["b"].float().sigmoid()
    outs, states = [], {}
    for row, (slot, keep) in enumerate(zip(SLOTS, HAS_STATE)):
        conv = args["conv_state"][slot].float() if keep else torch.zeros_like(weight[:, 1:])
        state = args["state"][slot].float() if keep else torch.zeros_like(args["state"][0])
        states[row] = []
        for t in range(row * q, (row + 1) * q):
            conv_out, conv = causal_conv1d_step(x[t : t + 1], weight, conv[None])
            conv = conv[0]
            qh, kh, vh = conv_out[0].split([hk * K, hk * K, hv * V])
            qh, kh = (h.view(hk, K).repeat_interleave(hv // hk, 0) for h in (qh, kh))
            qh, kh = prepare_qk(qh, kh)
            out, state = gated_delta_step(qh, kh, vh.view(hv, V), g[t], beta[t], state)
            outs.append(norm(out.cpu(), args["gate"][t].float().view(hv, V).cpu()))
            states[row].append((conv.clone(), state.clone()))
    return torch.stack(outs), states


def copy_states(args: dict) -> dict:
    kept = args["kept"]
    return {
        **args,
        "conv_state": args["conv_state"].clone(),
        "state": args["state"].clone(),
        "kept": None if kept is None else tuple(t.clone() for t in kept),
    }


def assert_states(args: dict, states: dict, q: int, tol: float) -> None:
    """Each real row's slot holds the state after its last token, ``kept`` those after each
    token before; nobody's slots are untouched (still NaN)."""
    close = lambda got, want: torch.testing.assert_close(
        got.float().cpu(), want.cpu(), atol=tol, rtol=tol
    )
    for row in (0, 2, 3):
        slot = SLOTS[row]
        close(args["conv_state"][slot], states[row][-1][0])
        close(args["state"][slot], states[row][-1][1])
        for t in range(q - 1):
            close(args["kept"][0][row, t], states[row][t][0])
            close(args["kept"][1][row, t], states[row][t][1])
    assert args["conv_state"][[2, 5]].isnan().all() and args["state"][[2, 5]].isnan().all()


@pytest.mark.parametrize(
    "hk, hv, q, dtype, tol",
    [
        (2, 4, 1, torch.float32, 1e-5),
        (2, 2, 3, torch.float32, 1e-5),
        (2, 4, 3, torch.float16, 2e-2),
    ],
)
def test_fused_decode_equals_unfused_kernels_and_reference(hk, hv, q, dtype, tol):
    args = layer(hk, hv, q, dtype)
    want, states = reference(args, q)
    unfused_args = copy_states(args)
    unfused_out = unfused(unfused_args)
    out = fused_gdn_decode(**args)
    assert out.dtype == dtype and out.shape == (len(SLOTS) * q, hv, V)
    # The same roundings as the unfused launches: equal up to the order of fp32 sums.
    same = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out, unfused_out, atol=same, rtol=same)
    for name in ("conv_state", "state"):
        torch.testing.assert_close(args[name], unfused_args[name], equal_nan=True)
    real = torch.tensor([0, 2, 3]).repeat_interleave(q) * q + torch.arange(q).repeat(3)
    torch.testing.assert_close(out[real].float(), want[real], atol=tol, rtol=tol)
    assert_states(args, states, q, tol)


def test_fused_decode_rejects_what_it_does_not_cover():
    args = layer(2, 4, 1, torch.float32)
    with pytest.raises(ValueError, match="gate"):
        fused_gdn_decode(**{**args, "gate": args["gate"][:, :-1]})
    with pytest.raises(ValueError, match="norm_weight"):
        fused_gdn_decode(**{**args, "norm_weight": args["norm_weight"][:-1]})
    big = torch.empty(6, 4, 256, 128)
    with pytest.raises(ValueError, match="too large"):
        fused_gdn_decode(**{**args, "state": big})


def fused_launches() -> None:
    """The fused launches of a Qwen3.5-0.8B (16 / 16 heads) and a 35B-A3B (16 / 32) decode
    step in bf16, and of a verification step of 4 tokens per row (for the lowering test)."""
    bf16 = torch.bfloat16
    slots, keep = torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.bool)
    for hv in (16, 32):
        conv_dim = 2 * 16 * 128 + hv * 128
        conv_state = torch.empty(5, conv_dim, 3, dtype=bf16)
        state = torch.empty(5, hv, 128, 128)
        for q in (1, 4):
            x = torch.empty(4 * q, conv_dim, dtype=bf16)
            zba = torch.empty(4 * q, hv * 130, dtype=bf16)
            kept = (
                torch.empty(4, q - 1, *conv_state.shape[1:], dtype=bf16),
                torch.empty(4, q - 1, *state.shape[1:]),
            )
            fused_gdn_decode(
                x, zba[:, : hv * 128], zba[:, hv * 128 : hv * 129], zba[:, hv * 129 :],
                torch.empty(conv_dim, 1, 4, dtype=bf16)[:, 0], torch.empty(hv), torch.empty(hv),
                torch.empty(128, dtype=bf16), EPS, conv_state, state, slots, keep, 16,
                kept if q > 1 else None,
            )  # fmt: skip


def test_fused_decode_lowers_for_hopper():
    assert check_lowering(
        "ops.test_gated_delta_fused:fused_launches",
        "heron.kernels.gated_delta_fused:_fused_decode_kernel",
    )


@pytest.mark.gpu
@pytest.mark.parametrize("hv, q", [(16, 1), (32, 1), (32, 3)])
def test_bf16_fused_decode_follows_the_fp32_reference(hv, q):
    """bf16 activations and conv state, fp32 recurrent state, at Qwen3.5's head dims."""
    args = layer(16, hv, q, torch.bfloat16, "cuda", seed=3, dims=(128, 128))
    want, states = reference(args, q)
    out = fused_gdn_decode(**args)
    real = torch.tensor([0, 2, 3]).repeat_interleave(q) * q + torch.arange(q).repeat(3)
    torch.testing.assert_close(out[real].float().cpu(), want[real], atol=5e-2, rtol=5e-2)
    assert_states(args, states, q, 5e-2)
