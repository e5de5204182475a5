"""Time a GDN layer's decode kernels (GPU, bf16, CUDA graphs, states cold in HBM): the three
launches (``causal_conv1d_update``, ``gated_delta_decode``, ``gated_rms_norm``) against the
fused one (``fused_gdn_decode``, at several warp counts), in µs per layer.

A CUDA graph runs the layer over enough copies of its states (and weights and inputs) to
overflow the L2 cache, every row continuing from a saved state in its own slot, so each launch
reads and writes its states from HBM as a real step's layers do. Before timing, both paths run
one step from equal states and the largest differences of their outputs and states are
printed (bf16 roundings only: they should be near zero).

    python benchmarks/gdn_decode_kernels.py [--rows 1 8 64] [--query-len 1] [--warps 4 8 16]

Shapes: Qwen3.5-0.8B's GDN layer (16 key heads, 16 value heads) and Qwen3.5-35B-A3B's (16 /
32), head dims 128, conv kernel 4.
"""

from __future__ import annotations

import argparse
import math
from functools import partial

import torch
from tune_gemv import time_us

from heron.kernels.gated_delta import gdn_decode
from heron.kernels.gated_delta_fused import fused_gdn_decode
from heron.kernels.rmsnorm import gated_rms_norm

SHAPES = {"qwen3_5_0.8b": (16, 16), "qwen3_5_35b_a3b": (16, 32)}  # key heads, value heads
DIM, WIDTH, EPS = 128, 4, 1e-6
COLD_BYTES = 256 << 20  # well past the H200's L2


def layer(hk: int, hv: int, rows: int, q: int) -> dict:
    """One layer's inputs, weights and states (rows in slots 1..rows; slot 0 the null slot)."""
    bf16, dev = torch.bfloat16, "cuda"
    conv_dim = (2 * hk + hv) * DIM
    zba = torch.randn(rows * q, hv * DIM + 2 * hv, device=dev, dtype=bf16)
    kept = None
    if q > 1:
        kept = (
            torch.zeros(rows, q - 1, conv_dim, WIDTH - 1, device=dev, dtype=bf16),
            torch.zeros(rows, q - 1, hv, DIM, DIM, device=dev),
        )
    return dict(
        x=torch.randn(rows * q, conv_dim, device=dev, dtype=bf16),
        gate=zba[:, : hv * DIM],
        a=zba[:, hv * DIM : hv * DIM + hv],
        b=zba[:, hv * DIM + hv :],
        conv_weight=torch.randn(conv_dim, 1, WIDTH, device=dev, dtype=bf16)[:, 0] * 0.5,
        A_log=torch.rand(hv, device=dev).log().to(bf16),
        dt_bias=torch.randn(hv, device=dev, dtype=bf16),
        norm_weight=torch.randn(DIM, device=dev, dtype=bf16),
        eps=EPS,
        conv_state=torch.randn(rows + 1, conv_dim, WIDTH - 1, device=dev, dtype=bf16),
        state=torch.randn(rows + 1, hv, DIM, DIM, device=dev) * 0.1,
        slots=torch.arange(1, rows + 1, device=dev, dtype=torch.int32),
        has_state=torch.ones(rows, device=dev, dtype=torch.bool),
        num_key_heads=hk,
        kept=kept,
    )


def three_launches(args: dict) -> torch.Tensor:
    rule = {k: v for k, v in args.items() if k not in ("gate", "norm_weight", "eps")}
    out = gdn_decode(**rule)
    return gated_rms_norm(out, args["gate"].view(out.shape), args["norm_weight"], EPS)


def fused(args: dict, num_warps: int) -> torch.Tensor:
    return fused_gdn_decode(**args, num_warps=num_warps)


def state_bytes(args: dict) -> int:
    """Bytes of recurrent and conv state a step reads and writes (the kernels' floor)."""
    rows = args["slots"].shape[0]
    per_row = args["state"][0].nbytes + args["conv_state"][0].nbytes
    return 2 * rows * per_row


def max_differences(args: dict) -> tuple[float, float, float]:
    """Largest |fused - three launches| of the output, conv state and recurrent state after
    one step from equal states."""
    other = {**args, "conv_state": args["conv_state"].clone(), "state": args["state"].clone()}
    if args["kept"] is not None:
        other["kept"] = tuple(t.clone() for t in args["kept"])
    fused, unfused = fused_gdn_decode(**args), three_launches(other)
    return tuple(
        (mine.float() - theirs.float()).abs().max().item()
        for mine, theirs in (
            (fused, unfused),
            (args["conv_state"], other["conv_state"]),
            (args["state"], other["state"]),
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--query-len", type=int, default=1, help="tokens per row (verification)")
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8, 16])
    args = parser.parse_args()
    q = args.query_len
    columns = ["three launches", *(f"fused {w} warps" for w in args.warps)]
    print(f"GDN decode kernels, {q} token(s) per row: µs per layer (state GB/s)")
    print(f"| shape | rows | max diff out / conv / state | {' | '.join(columns)} |")
    print("| --- | --- | --- |" + " --- |" * len(columns))
    for name, (hk, hv) in SHAPES.items():
        for rows in args.rows:
            first = layer(hk, hv, rows, q)
            diffs = "{:.1e} / {:.1e} / {:.1e}".format(*max_differences(first))
            copies = max(2, math.ceil(COLD_BYTES / state_bytes(first)))
            layers = [first] + [layer(hk, hv, rows, q) for _ in range(copies - 1)]
            nbytes = state_bytes(first)
            cells = []
            timings = [three_launches] + [partial(fused, num_warps=w) for w in args.warps]
            for launch in timings:
                us = time_us(launch, layers)
                cells.append(f"{us:.2f} ({nbytes / us / 1e3:.0f})")
            print(f"| {name} | {rows} | {diffs} | {' | '.join(cells)} |")
            del layers, first
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
