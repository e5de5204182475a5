"""The LoRA shrink/expand kernels under Triton's interpreter against dense per-token PyTorch
(fp32): mixed slots, the input's width split over programs, the base model's slot 0, a slot no
token uses, ranks 8 and 64, tails of the input and output widths; their lowering for sm_90; a
layer whose GEMV base product adds the update in its epilogue."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from triton_lowering import check_lowering

from heron.kernels import TORCH_KERNELS, gemv, lora, lora_gemv
from heron.kernels.lora import lora_expand, lora_shrink
from heron.layers.linear import Linear
from heron.lora.adapter import LoRAPair
from heron.lora.builder import LoRAView
from heron.lora.config import LoRAConfig
from heron.lora.layer import LoRALinear
from heron.metadata import ModelBuildContext

SLOTS = [0, 2, 2, 1, 0, 2]  # slot 3 holds an adapter no token uses


def _tables(rank: int, k: int, n: int, dtype: torch.dtype):
    torch.manual_seed(rank)
    a = torch.randn(4, rank, k, dtype=dtype)
    b = torch.randn(4, n, rank, dtype=dtype)
    a[0], b[0] = 0, 0  # slot 0: the base model
    return a, b


@pytest.mark.parametrize("wide", [16, 1])  # expand tiles of 64 columns, or 128
@pytest.mark.parametrize("programs", [512, 12])  # K in one slice per program, or two
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rank", [8, 64])
def test_shrink_expand_equal_dense_per_token(rank, dtype, programs, wide, monkeypatch):
    monkeypatch.setattr(lora, "_PROGRAMS", programs)
    monkeypatch.setattr(lora, "_WIDE_TOKENS", wide)
    k, n = 300, 200  # K: three slices of 128, the last cut short; N: tiles cut short
    a, b = _tables(rank, k, n, dtype)
    x = torch.randn(len(SLOTS), k, dtype=dtype)
    y = torch.randn(len(SLOTS), n, dtype=dtype)
    slots = torch.tensor(SLOTS, dtype=torch.int32)
    want = torch.stack(
        [
            y[t].float() + (x[t].float() @ a[s].float().T) @ b[s].float().T
            for t, s in enumerate(SLOTS)
        ]
    )
    shrunk = lora_shrink(x, a, slots)
    torch.testing.assert_close(
        shrunk.sum(1),
        torch.stack([x[t].float() @ a[s].float().T for t, s in enumerate(SLOTS)]),
        atol=1e-4,
        rtol=1e-4,
    )
    got = lora_expand(shrunk, b, slots, y.clone())
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol * want.abs().max(), rtol=tol)


def lora_launches() -> None:
    """Decode- and prefill-sized launches in bf16 (the lowering test's)."""
    for t, rank in ((1, 16), (64, 48), (300, 192)):
        a = torch.empty(9, rank, 1024, dtype=torch.bfloat16)
        b = torch.empty(9, 4096, rank, dtype=torch.bfloat16)
        slots = torch.zeros(t, dtype=torch.int32)
        y = torch.empty(t, 4096, dtype=torch.bfloat16)
        lora_expand(lora_shrink(torch.empty(t, 1024, dtype=torch.bfloat16), a, slots), b, slots, y)


def test_kernels_lower_for_sm90():
    assert check_lowering(
        "lora.test_lora_kernels:lora_launches",
        "heron.kernels.lora:_shrink_kernel",
        "heron.kernels.lora:_expand_kernel",
    )


def test_a_gemv_base_product_adds_the_update_in_its_epilogue(monkeypatch):
    """A LoRA layer whose base product takes the GEMV (fp16, interpreted) adds the tokens'
    updates in the base product's launch, launching no expand: one token in the GEMV's
    epilogue, a step of up to 64 tokens of mixed slots in ``lora_gemv``. Each row equals the
    dense product with its slot's whole weight ``W + B A`` (slot 0: ``W``). A step of more rows
    is left to the expand."""
    kernels = dataclasses.replace(
        TORCH_KERNELS,
        gemv=gemv.linear_small_m,
        gemv_serves=gemv.serves,
        lora_shrink=lora_shrink,
        lora_expand=None,  # (called, it would fail)
        lora_gemv=lora_gemv.lora_linear,
        lora_gemv_serves=lora_gemv.serves,
    )
    with ModelBuildContext():
        layer = Linear(96, 80, True, kernels)
        layer.lora = LoRALinear("proj.lora", layer, LoRAConfig(3, 8))
    torch.manual_seed(0)
    layer.weight.data.normal_(0, 0.1)
    layer.bias.data.normal_(0, 0.1)
    pairs = {s: LoRAPair(torch.randn(8, 96) * 0.1, torch.randn(80, 8) * 0.1) for s in (1, 2, 3)}
    for slot, pair in pairs.items():
        layer.lora.set_slot(slot, {None: pair})
    layer.half()
    for slots in ([2], [0], [1], [1, 0, 3, 3, 2], [3, 1, 0, 2] * 5):
        view = LoRAView(torch.tensor(slots, dtype=torch.int32), None)
        layer.lora.bind(SimpleNamespace(view=view))
        x = torch.randn(len(slots), 96).half()
        assert layer.lora.fuses(x, layer.weight)
        updates = [pairs[s].b @ pairs[s].a if s else torch.zeros(80, 96) for s in slots]
        weights = layer.weight.float() + torch.stack(updates)
        want = torch.einsum("tk,tnk->tn", x.float(), weights) + layer.bias.float()
        got = layer(x)
        torch.testing.assert_close(got.float(), want, atol=2e-2 * want.abs().max(), rtol=2e-2)
    x = torch.randn(65, 96).half()
    layer.lora.bind(SimpleNamespace(view=LoRAView(torch.ones(65, dtype=torch.int32), None)))
    assert not layer.lora.fuses(x, layer.weight)


def test_a_pair_beyond_the_tables_dtype_is_refused():
    """A pair whose (scaled) weights overflow the layer's half-precision tables is refused at
    load, by what overflows: an unused slot's B is read (times zero) by every row's product."""
    with ModelBuildContext():
        layer = Linear(96, 80, True, TORCH_KERNELS)
        layer.lora = LoRALinear("proj.lora", layer, LoRAConfig(3, 8))
    layer.half()
    fits = LoRAPair(torch.randn(8, 96), torch.randn(80, 8))
    assert layer.lora.check(None, fits) is None
    fits.b[3, 1] = 1e5
    assert "overflows torch.float16" in layer.lora.check(None, fits)
