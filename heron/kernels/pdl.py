"""Programmatic dependent launch (PDL) for Heron's Triton kernels.

On Hopper and newer GPUs a kernel launched with PDL is scheduled as soon as the programs of the
kernel before it on the stream have exited, before that kernel has fully completed and flushed
its writes, and waits at ``griddepcontrol.wait`` until it has. A decode step at small batch is
some two hundred short kernels replayed from a CUDA graph, and the gap between one kernel's end
and the next one's start is a sizeable part of the step; PDL takes part of it off the critical
path.

Every participating kernel calls :func:`wait_for_previous_kernel` first, before it reads or
writes anything, so each kernel still does all its work after the one before it completed (the
order is exactly the stream's), except loads of memory no running kernel writes (the decode
attention's cached keys, the fused GDN decode's recurrent state, the input and weight of a
one-token GEMV after LoRA's shrink, which started it only once that input was complete).
Kernels do not, as a rule, signal their dependents early
(``griddepcontrol.launch_dependents``): that makes the next kernel's programs resident while
the current one runs, crowding its multiprocessors, and was measured slower. The exceptions
call :func:`start_next_kernel`: the qk-norm/RoPE/KV-write kernel on every decode step, before
the decode attention (which loads cached keys before its wait); and, where their launch fits
one wave (:func:`fits_one_wave`), so that the next kernel's programs take multiprocessors this
one leaves idle, the RMSNorm kernel before the projection that reads it, LoRA's shrink and
expand, and the decode attention before its output projection. Kernels that do not take part
(PyTorch's, cuBLAS's) launch and wait as usual. ``HERON_PDL=0`` turns it off.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from heron import envs

_ENABLED: dict[torch.device, bool] = {}
_MULTIPROCESSORS: dict[torch.device, int] = {}


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL: CUDA compute capability 9.0 or newer,
    unless the environment sets ``HERON_PDL=0``."""
    enabled = _ENABLED.get(device)
    if enabled is None:
        enabled = (
            device.type == "cuda"
            and torch.cuda.get_device_capability(device)[0] >= 9
            and envs.pdl()
        )
        _ENABLED[device] = enabled
    return enabled


def pdl_launch(device: torch.device) -> dict[str, bool]:
    """The keyword arguments that launch a participating kernel on ``device``: its ``USE_PDL``
    flag and Triton's ``launch_pdl`` (which the interpreter ignores)."""
    enabled = pdl_enabled(device)
    return {"USE_PDL": enabled, "launch_pdl": enabled}


def multiprocessor_count(device: torch.device) -> int:
    """The multiprocessors of a CUDA ``device``; 4 elsewhere (Triton's interpreter in tests,
    where any small count does)."""
    if device.type != "cuda":
        return 4
    count = _MULTIPROCESSORS.get(device)
    if count is None:
        count = torch.cuda.get_device_properties(device).multi_processor_count
        _MULTIPROCESSORS[device] = count
    return count


def fits_one_wave(device: torch.device, programs: int) -> bool:
    """Whether a launch of ``programs`` programs has at most one per multiprocessor of
    ``device``, so that a kernel may let the next one start early (:func:`start_next_kernel`)
    without crowding its own programs."""
    return programs <= multiprocessor_count(device)


@triton.jit
def wait_for_previous_kernel(USE_PDL: tl.constexpr):
    """Waits until the previous kernel on the stream has completed and its writes are visible.
    A no-op without ``USE_PDL``."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def start_next_kernel(USE_PDL: tl.constexpr):
    """Lets the next kernel's programs be scheduled now, while this one runs (once every program
    of this kernel has called it or exited). They still wait at
    :func:`wait_for_previous_kernel` for this kernel to complete; what they do before that wait
    may only read memory that no running kernel writes. A no-op without ``USE_PDL``."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
