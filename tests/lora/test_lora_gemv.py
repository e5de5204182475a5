"""The one-launch LoRA product (base GEMV, shrink and expand in one kernel) under Triton's
interpreter against dense per-row PyTorch: rows of mixed slots (slot 0 among them), split-K,
the shrink over several chunks of K, packed parts, and the counters handed back."""

from __future__ import annotations

import pytest
import torch
from triton_lowering import check_lowering

from heron.kernels import lora_gemv
from heron.kernels.gemv import GemvConfig
from heron.kernels.lora_gemv import lora_linear

SLOTS = 4  # tables of slots 0..3, slot 0 zero


def _tables(k: int, n: int, rank: int, parts: tuple[int, ...], dtype: torch.dtype):
    """A and B tables as a packed LoRA layer holds them: part ``i``'s ranks in columns ``[i r,
    (i + 1) r)`` of ``A``'s rows and of its own rows of ``B``."""
    g = torch.Generator().manual_seed(k + n)
    starts = (0, *parts, n)
    width = rank * (len(starts) - 1)
    a = torch.randn(SLOTS, width, k, generator=g) * 0.1
    b = torch.zeros(SLOTS, n, width)
    for i in range(len(starts) - 1):
        rows, cols = slice(starts[i], starts[i + 1]), slice(i * rank, (i + 1) * rank)
        b[:, rows, cols] = torch.randn(SLOTS, starts[i + 1] - starts[i], rank, generator=g) * 0.1
    a[0], b[0] = 0, 0
    return a.to(dtype), b.to(dtype)


def _reference(x, w, bias, a, b, slots):
    rows = []
    for t, s in enumerate(slots):
        update = (x[t].float() @ a[s].float().T) @ b[s].float().T
        rows.append(x[t].float() @ w.float().T + update)
    y = torch.stack(rows)
    return y if bias is None else y + bias.float()


def _forced(monkeypatch, cfg: GemvConfig | None, sms: int, shrink_k: int, chunks: int) -> None:
    lora_gemv._plan.cache_clear()
    monkeypatch.setattr(lora_gemv, "multiprocessor_count", lambda device: sms)
    monkeypatch.setattr(lora_gemv, "_SHRINK_K", shrink_k)
    monkeypatch.setattr(lora_gemv, "_CHUNKS", chunks)
    if cfg is not None:
        monkeypatch.setattr(lora_gemv, "_config", lambda *args: cfg)


CASES = [  # (forced config, multiprocessors, K per shrink tile, most chunks a row)
    (None, 4, 512, 16),  # the GEMV's rule: one program per column block; the shrink in one chunk
    (GemvConfig(True, 32, 64, 4, 1, 2), 16, 128, 16),  # K split in two; three chunks of a tile
    (GemvConfig(True, 16, 128, 4, 2, 1), 16, 64, 2),  # narrow tiles; two chunks of three tiles
]


@pytest.mark.parametrize(
    "case,dtype", [(0, torch.float32), (0, torch.float16), (1, torch.float32), (2, torch.float32)]
)
def test_one_launch_equals_dense_per_row(case, dtype, monkeypatch):
    _forced(monkeypatch, *CASES[case])
    k, n = 320, 96
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for parts, rank in [((), 12), ((32, 64), 8), ((48,), 16)]:
        a, b = _tables(k, n, rank, parts, dtype)
        for slots, bias in [
            ([1, 0, 3, 3, 2], True),
            ([2, 2], False),  # one adapter: its slot's columns alone
            ([0, 3, 0, 0, 3], True),  # one adapter and the base model
            ([0, 0, 0], False),  # the base model alone (a graph's step without adapters)
            ([3, 1, 0, 2] * 5, True),
        ]:
            g = torch.Generator().manual_seed(len(slots))
            x = torch.randn(len(slots), k, generator=g).to(dtype)
            w = (torch.randn(n, k, generator=g) * 0.1).to(dtype)
            bv = torch.randn(n, generator=g).to(dtype) if bias else None
            index = torch.tensor(slots, dtype=torch.int32)
            want = _reference(x, w, bv, a, b, slots)
            got = lora_linear(x, w, bv, a, b, index, parts)
            torch.testing.assert_close(got.float(), want, atol=tol * want.abs().max(), rtol=tol)
    # The counters were handed back: the same call again gives the same result.
    assert torch.equal(lora_linear(x, w, bv, a, b, index, parts), got)


def test_what_it_does_not_take_is_refused(monkeypatch):
    """One row (the GEMV's epilogue serves it), more than a launch's rows, a copy of ``x``
    or mismatched tables are refused; ``serves`` says so beforehand."""
    _forced(monkeypatch, None, 4, 256, 16)
    a, b = _tables(64, 32, 8, (), torch.float32)
    w = torch.randn(32, 64)
    assert lora_gemv.serves(2, 32, 64, torch.device("cpu"), 4)
    assert not lora_gemv.serves(1, 32, 64, torch.device("cpu"), 4)
    assert not lora_gemv.serves(65, 32, 64, torch.device("cpu"), 4)
    for x, slots, tables in [
        (torch.randn(1, 64), [1], (a, b)),
        (torch.randn(65, 64), [1] * 65, (a, b)),
        (torch.randn(64, 2).T, [1, 1], (a, b)),
        (torch.randn(2, 64), [1, 1], (a, b[:, :16])),
        (torch.randn(2, 64), [1], (a, b)),
    ]:
        with pytest.raises(ValueError, match="lora_linear"):
            lora_linear(x, w, None, *tables, torch.tensor(slots, dtype=torch.int32))


def lora_gemv_launches() -> None:
    """Decode steps of 2, 16 and 64 rows over Qwen3-0.6B's projections (qkv packed, gate_up
    packed, o, down), 8 slots of rank 16, in bf16, planned for 132 multiprocessors (the
    lowering test's)."""
    from heron.kernels import gemv

    gemv.multiprocessor_count = lora_gemv.multiprocessor_count = lambda device: 132
    projections = [
        (4096, 1024, (2048, 3072)),
        (1024, 2048, ()),
        (6144, 1024, (3072,)),
        (1024, 3072, ()),
    ]
    for (n, k, parts), m in ((p, m) for p in projections for m in (2, 16, 64)):
        width = 16 * (len(parts) + 1)
        lora_linear(
            torch.empty(m, k, dtype=torch.bfloat16),
            torch.empty(n, k, dtype=torch.bfloat16),
            None,
            torch.empty(9, width, k, dtype=torch.bfloat16),
            torch.empty(9, n, width, dtype=torch.bfloat16),
            torch.empty(m, dtype=torch.int32),
            parts,
        )


def test_kernel_lowers_for_sm90():
    assert check_lowering(
        "lora.test_lora_gemv:lora_gemv_launches", "heron.kernels.lora_gemv:_lora_gemv_kernel"
    )


@pytest.mark.gpu
def test_gpu_bf16_graph_replays_any_mix_of_slots():
    """bf16 on CUDA, Qwen3-0.6B's packed qkv with 8 slots of rank 16: one CUDA graph of the
    launch replays steps of other slots (the counters handed back at every replay), equal to
    the eager launch and close to dense fp32."""
    lora_gemv._plan.cache_clear()
    n, k, parts = 4096, 1024, (2048, 3072)
    a, b = _tables(k, n, 16, parts, torch.bfloat16)
    a, b = a.cuda(), b.cuda()
    x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
    slots = torch.zeros(64, dtype=torch.int32, device="cuda")
    lora_linear(x, w, None, a, b, slots, parts)  # (eager first: counters allocated)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = lora_linear(x, w, None, a, b, slots, parts)
    mixes = [[(i + step) % SLOTS for i in range(64)] for step in range(3)]
    mixes += [[2] * 64, [0, 3] * 32, [0] * 64]  # one adapter; one and the base; none
    for mix in mixes:
        slots.copy_(torch.tensor(mix, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, lora_linear(x, w, None, a, b, slots, parts))
        want = _reference(x, w, None, a, b, mix)
        assert ((out.float() - want).abs().max() / want.abs().max()).item() < 2e-2
