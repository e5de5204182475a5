"""Sleep mode's weights: a model's parameters and buffers taken off the device and put back.

The tensors are released, not kept at fixed addresses: everything that read them (CUDA graphs,
the builders' graph buffers, the metadata views) is released with them and rebuilt after
wake-up (:meth:`ModelRunner.wake_up`), so no replay reads a freed tensor.
"""

from __future__ import annotations

import torch
from torch import nn


class ReleasedWeights:
    """The parameters and buffers of ``models`` (each shared tensor once), released from the
    device: parameters copied to host memory first where ``keep`` (sleep level 1; pinned for
    the copy back), else discarded (level 2: they come back zeroed, for a weight update to
    fill); buffers (RoPE tables, constants) always kept."""

    def __init__(self, models: list[nn.Module], keep: bool) -> None:
        self._params = _unique(p for m in models for p in m.parameters())
        self._buffers = _unique(b for m in models for b in m.buffers())
        self.kept = keep
        self._host = [_to_host(p.data) if keep else None for p in self._params]
        self._host_buffers = [_to_host(b.data) for b in self._buffers]
        self._shapes = [(p.shape, p.dtype, p.device) for p in self._params]
        self._buffer_devices = [b.device for b in self._buffers]
        for tensor in (*self._params, *self._buffers):
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)

    def restore(self) -> None:
        """Every tensor back on its device: the kept copies, or zeros of the discarded
        parameters' shapes."""
        for param, host, (shape, dtype, device) in zip(self._params, self._host, self._shapes):
            if host is None:
                param.data = torch.zeros(shape, dtype=dtype, device=device)
            else:
                param.data = host.to(device, non_blocking=True)
        for buffer, host, device in zip(self._buffers, self._host_buffers, self._buffer_devices):
            buffer.data = host.to(device, non_blocking=True)
        if any(d.type == "cuda" for _, _, d in self._shapes):
            torch.cuda.synchronize()  # (the pinned copies are then free to go)
        self._host = self._host_buffers = []


def _unique(tensors) -> list[torch.Tensor]:
    """Each tensor once (a tied embedding and LM head share one parameter)."""
    seen: dict[int, torch.Tensor] = {}
    for t in tensors:
        seen.setdefault(id(t), t)
    return list(seen.values())


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of a device tensor (pinned); a host tensor is its own (nothing to free)."""
    if tensor.device.type == "cpu":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor)
