"""FP8 linear products against bf16 on a GPU, per projection of the Qwen3-0.6B shape and per
row count: the bf16 layer, the FP8 layer as the Triton set runs it (the FP8 GEMV up to its rows,
FP8 tensor cores past them), the tensor cores' product with PyTorch's activation quantisation
and with the one-launch Triton one, and the activation quantisation alone. Device time: µs per
call in CUDA-graph replays over copies of the layer that overflow the L2 cache (eager timing
of these microsecond kernels measures the host's launches instead).

    PYTHONPATH=$PWD python3 benchmarks/fp8_linear.py [--rows 1 16 64 256]
"""

from __future__ import annotations

import argparse

import torch

from heron.bench.kernel import COLD_BYTES
from heron.bench.measure import device_time_us
from heron.kernels.fp8_quant import quantize_rows
from heron.layers.fp8 import quantize, scaled_mm
from heron.layers.linear import Linear
from heron.ops.selector import layer_kernels

# (name, N, K) of one Qwen3-0.6B decoder layer.
SHAPES = [("qkv_proj", 4096, 1024), ("o_proj", 1024, 2048), ("gate_up", 6144, 1024),
          ("down_proj", 1024, 3072)]  # fmt: skip


def layer(n: int, k: int, fp8: bool) -> Linear:
    out = Linear(k, n, kernels=layer_kernels("triton")).cuda()
    out.weight.data = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    if fp8:
        out.quantize_fp8()
    return out


def row_times(x: torch.Tensor, bf16: list[Linear], fp8: list[Linear]) -> list[float]:
    """µs per call of each column's product (or quantisation) of ``x``."""
    mm_triton_q = lambda lin: scaled_mm(  # noqa: E731
        x, lin.weight, lin.weight_scale, quantize_rows=quantize_rows
    )
    return [
        device_time_us(lambda lin: lin(x), bf16),
        device_time_us(lambda lin: lin(x), fp8),
        device_time_us(lambda lin: scaled_mm(x, lin.weight, lin.weight_scale), fp8),
        device_time_us(mm_triton_q, fp8),
        device_time_us(lambda _: quantize(x), fp8),
        device_time_us(lambda _: quantize_rows(x), fp8),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    args = parser.parse_args()
    columns = ["bf16", "fp8 layer", "mm torch-q", "mm triton-q", "q torch", "q triton"]
    print(f"{'shape':>24} {'rows':>5} " + " ".join(f"{c:>11}" for c in columns) + "   (us)")
    for name, n, k in SHAPES:
        # Enough copies of each layer to overflow the L2 cache: every call reads its weight
        # from HBM, as a decode step does.
        copies = max(1, -(-COLD_BYTES // (n * k * 2)))
        bf16 = [layer(n, k, False) for _ in range(copies)]
        fp8 = [layer(n, k, True) for _ in range(copies)]
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            times = row_times(x, bf16, fp8)
            shape = f"{name} {n}x{k}"
            print(f"{shape:>24} {m:>5} " + " ".join(f"{t:>11.1f}" for t in times), flush=True)
        del bf16, fp8
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
