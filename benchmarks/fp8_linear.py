"""FP8 linear products against bf16 on a GPU, per projection of the Qwen3-0.6B shape and per
row count: the bf16 layer, the FP8 layer as the Triton set runs it (the FP8 GEMV up to its rows,
FP8 tensor cores past them), the tensor cores' product with PyTorch's activation quantisation
and with the one-launch Triton one, and the activation quantisation alone.

    PYTHONPATH=$PWD python3 benchmarks/fp8_linear.py [--rows 1 16 64 256]
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
from triton.testing import do_bench

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


def microseconds(fn) -> float:
    return do_bench(fn, warmup=25, rep=200) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    args = parser.parse_args()
    columns = ["bf16", "fp8 layer", "mm torch-q", "mm triton-q", "q torch", "q triton"]
    print(f"{'shape':>24} {'rows':>5} " + " ".join(f"{c:>11}" for c in columns) + "   (us)")
    for name, n, k in SHAPES:
        bf16, fp8 = layer(n, k, False), layer(n, k, True)
        q, s = fp8.weight, fp8.weight_scale
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            runs = [
                partial(bf16, x),
                partial(fp8, x),
                partial(scaled_mm, x, q, s),
                partial(scaled_mm, x, q, s, quantize_rows=quantize_rows),
                partial(quantize, x),
                partial(quantize_rows, x),
            ]
            times = [microseconds(run) for run in runs]
            shape = f"{name} {n}x{k}"
            print(f"{shape:>24} {m:>5} " + " ".join(f"{t:>11.1f}" for t in times), flush=True)


if __name__ == "__main__":
    main()
