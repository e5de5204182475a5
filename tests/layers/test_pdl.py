"""Programmatic dependent launch: when it is on, and what the launch keywords are."""

import pytest
import torch

from heron.layers import pdl


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
