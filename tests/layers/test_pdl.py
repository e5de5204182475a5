"""Programmatic dependent launch: when it is on, and what the launch keywords are."""

import pytest
import torch

from heron.kernels import pdl


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch):
    monkeypatch.setattr(pdl, "_ENABLED", {})


def test_off_on_the_cpu():
    cpu = torch.device("cpu")
    assert not pdl.pdl_enabled(cpu)
    assert pdl.pdl_launch(cpu) == {"USE_PDL": False, "launch_pdl": False}


@pytest.mark.gpu
def test_on_for_hopper_unless_disabled(monkeypatch):
    device = torch.device("cuda", torch.cuda.current_device())
    hopper = torch.cuda.get_device_capability(device)[0] >= 9
    assert pdl.pdl_enabled(device) == hopper
    monkeypatch.setattr(pdl, "_ENABLED", {})
    monkeypatch.setenv("HERON_PDL", "0")
    assert not pdl.pdl_enabled(device)


def test_one_wave_rule_off_cuda():
    cpu = torch.device("cpu")
    assert pdl.multiprocessor_count(cpu) == 4  # the interpreter's stand-in
    assert pdl.fits_one_wave(cpu, 4) and not pdl.fits_one_wave(cpu, 5)


@pytest.mark.gpu
def test_multiprocessor_count_on_cuda():
    device = torch.device("cuda", torch.cuda.current_device())
    count = torch.cuda.get_device_properties(device).multi_processor_count
    assert pdl.multiprocessor_count(device) == count
    assert pdl.fits_one_wave(device, count) and not pdl.fits_one_wave(device, count + 1)


def test_one_wave_launches_start_the_next_kernel(monkeypatch):
    """The RMSNorm and the decode attention let the next kernel start early exactly when their
    launch fits one wave (4 multiprocessors off CUDA)."""
    from triton_lowering import _Recorder

    from heron.kernels import attention_decode, rmsnorm

    norm = _Recorder()
    monkeypatch.setattr(rmsnorm, "_rms_norm_kernel", norm)
    for rows in (4, 160):  # 64 columns: 32 rows a program, so 1 and 5 programs
        rmsnorm.rms_norm(torch.zeros(rows, 64), torch.ones(64), 1e-6)
    assert [kwargs["START_NEXT"] for _, kwargs in norm.calls] == [True, False]

    attention = _Recorder()
    monkeypatch.setattr(attention_decode, "_decode_kernel", attention)
    cache = torch.zeros(2, 8, 16, 1, 64)
    for batch in (1, 2):  # 4 splits of one KV head: 4 and 8 programs
        q = torch.zeros(batch, 2, 64)
        tables = torch.zeros(batch, 8, dtype=torch.int32)
        starts = torch.zeros(batch, dtype=torch.int32)
        lens = torch.full((batch,), 100, dtype=torch.int32)
        attention_decode.paged_decode_attention(
            q, cache, tables, starts, lens, 0.125, None, torch.empty_like(q), num_splits=4
        )
    assert [kwargs["START_NEXT"] for _, kwargs in attention.calls] == [True, False]
