"""Compile Triton kernel launches for an H100/H200 (sm_90) target, without a GPU.

The CPU tests run kernels in Triton's interpreter, which executes them as Python and so never
meets code that Triton's compiler rejects (a tile-shape mismatch in a branch it compiles
anyway, say). :func:`check_lowering` runs, in a Python without the interpreter, a function that
makes launches on CPU tensors while the kernels are replaced by recorders, then compiles every
distinct recorded launch to a cubin (Triton's passes, then ptxas, so inline PTX is checked
too), with programmatic dependent launch fully on, and checks that it fits the shared memory
of one program. Arguments are specialised as Triton's launcher does (pointers and integers
divisible by 16 are marked so): without that, the compiler cannot vectorise the loads, does
not pipeline them through shared memory, and reports a fraction of the shared memory and
twice the registers that the real launch uses.

    check_lowering("layers.test_triton_gemv:gemv_launches", "heron.kernels.gemv:_gemv_kernel")
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

_TARGET = ("cuda", 90, 32)
_MAX_SHARED = 232448  # bytes of shared memory a program may use on an H100/H200 (227 KB)


def check_lowering(launches: str, *kernels: str) -> int:
    """Lower each launch that ``launches`` (``module:function``, importable from ``tests/``)
    makes of the ``kernels`` (``module:attribute`` each); return how many distinct ones
    lowered. Every kernel must be launched at least once."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    tests = str(Path(__file__).parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [tests, env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, __file__, launches, *kernels],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    return int(result.stdout.split()[-1])


class _Recorder:
    """Stands in for a kernel: ``kernel[grid](*args, **kwargs)`` records the call."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def _signature_type(value) -> str:
    """Triton's signature type of a launch argument (None: a constexpr)."""
    import torch

    if value is None:
        return "constexpr"
    if isinstance(value, torch.Tensor):
        return "*" + {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
                      torch.float8_e4m3fn: "fp8e4nv", torch.int32: "i32",
                      torch.int64: "i64", torch.bool: "i1", torch.uint8: "u8"}[value.dtype]  # fmt: skip
    if isinstance(value, float):
        return "fp32"
    return "i32" if -(2**31) <= value < 2**31 else "i64"


def _divisible_by_16(value) -> bool:
    """Whether Triton's launcher would mark the argument divisible by 16 (its "D"
    specialisation: a pointer aligned to 16 bytes, an integer multiple of 16)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.data_ptr() % 16 == 0
    return isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0


def _launch_key(args: tuple, kwargs: dict) -> tuple:
    """What makes two launches compile differently: types, specialisations, constexprs."""
    return (
        tuple(map(_signature_type, args)),
        tuple(map(_divisible_by_16, args)),
        tuple(sorted(map(str, kwargs.items()))),
    )


def _lower(fn, args: tuple, kwargs: dict) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    constexprs = {name: kwargs[name] for name in names[len(args) :]}
    constexprs.update({n: None for n, a in zip(names, args) if a is None})
    for flag in ("USE_PDL", "FP8_CVT"):  # as on an H200
        if flag in constexprs:
            constexprs[flag] = True
    types = {n: _signature_type(a) for n, a in zip(names, args)}
    types.update(dict.fromkeys(constexprs, "constexpr"))
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(args) if _divisible_by_16(a)}
    source = ASTSource(fn, types, {(names.index(n),): v for n, v in constexprs.items()}, attrs)
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    compiled = triton.compile(source, target=GPUTarget(*_TARGET), options=options)
    shared = compiled.metadata.shared
    assert shared <= _MAX_SHARED, f"needs {shared} bytes of shared memory, at most {_MAX_SHARED}"


def _main(launches: str, *kernels: str) -> None:
    recorded = {}  # kernel spec: (the kernel, its recorder)
    for spec in kernels:
        module_name, attribute = spec.split(":")
        module = importlib.import_module(module_name)
        recorded[spec] = (getattr(module, attribute), _Recorder())
        setattr(module, attribute, recorded[spec][1])
    launch_module, function = launches.split(":")
    getattr(importlib.import_module(launch_module), function)()
    failures, count = [], 0
    for spec, (fn, recorder) in recorded.items():
        assert recorder.calls, f"{spec} was not launched"
        distinct = {}
        for args, kwargs in recorder.calls:
            distinct.setdefault(_launch_key(args, kwargs), (args, kwargs))
        for args, kwargs in distinct.values():
            try:
                _lower(fn, args, kwargs)
            except Exception as e:
                failures.append(f"{spec} {kwargs}: {str(e).splitlines()[0]}")
        count += len(distinct)
    assert not failures, "\n".join(failures)
    print("lowered", count)


if __name__ == "__main__":
    _main(*sys.argv[1:])
