"""Launch configurations of the W4A16 kernels (``heron.kernels.wna16``), measured on the GPU.

For each weight shape of a model (int4 in groups of 128, as the usual AWQ/GPTQ releases) and
row count (1: the decode GEMV; 64: the GEMM of a batch), every candidate configuration is
timed against the default rule and against the bf16 product (``torch.nn.functional.linear``),
with the weights cold in HBM (several copies, taken in turn). ``--write`` stores the winners
in ``heron/kernels/configs/wna16.json`` under this device's name.

    python benchmarks/tune_wna16.py [--model qwen3-8b] [--rows 1 64] [--write]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton

from heron.kernels import wna16
from heron.layers.wna16 import dequantize

# [N, K] of each packed linear: fused q/k/v, o, fused gate/up, down.
SHAPES = {"qwen3-8b": [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]}
# Candidates (block_m, block_n, block_k, num_warps, num_stages), each shape taking them all.
GEMV = list(itertools.product([1], [4, 8, 16], [512, 1024, 2048], [4, 8], [3]))
GEMM = list(itertools.product([64], [64, 128], [64, 128], [4, 8], [3, 4]))
BITS, GROUP, COPIES = 4, 128, 4
RULE = wna16.launch_config  # (each candidate is tried in its place)


def packed(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    qweight = torch.randint(-(2**31), 2**31 - 1, (n, k * BITS // 32), dtype=torch.int32)
    scales = torch.rand(n, k // GROUP, dtype=torch.bfloat16) / 64
    return qweight.cuda(), scales.cuda()


def timed(fn, copies: list) -> float:
    """Median µs of ``fn(*copy)`` over the copies in turn (cold weights)."""
    turn = itertools.cycle(copies)
    return triton.testing.do_bench(lambda: fn(*next(turn)), warmup=10, rep=40) * 1e3


def run(rows: int, n: int, k: int, device: torch.device) -> tuple[dict, list]:
    x = torch.randn(rows, k, dtype=torch.bfloat16, device=device)
    weights = [packed(n, k) for _ in range(COPIES)]
    dense = [(torch.randn(n, k, dtype=torch.bfloat16, device=device),) for _ in range(COPIES)]
    bf16 = timed(lambda w: torch.nn.functional.linear(x, w), dense)
    want = dequantize(*weights[0], None, BITS, GROUP).to(torch.float32) @ x.float().T
    candidates = GEMV if rows <= wna16.GEMV_MAX_M else GEMM
    default = RULE(rows, n, k, BITS, GROUP, torch.device("cpu"))
    results = []
    try:
        for cfg in [default, *candidates]:
            wna16.launch_config = lambda *_, cfg=cfg: cfg
            try:
                got = wna16.wna16_linear(x, *weights[0], None, BITS, GROUP).float()
                if (got.T - want).norm() > 1e-2 * want.norm():
                    raise AssertionError("wrong result")
                us = timed(lambda q, s: wna16.wna16_linear(x, q, s, None, BITS, GROUP), weights)
            except Exception as error:  # (a tile too large for the registers or shared memory)
                print(f"  {cfg}: {type(error).__name__}")
                continue
            results.append((us, list(cfg)))
    finally:
        wna16.launch_config = RULE
    rule = next((us for us, cfg in results if cfg == list(default)), float("nan"))
    return {"bf16": bf16, "default": rule}, sorted(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="qwen3-8b")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    data = json.loads(wna16.TUNED_PATH.read_text()) if wna16.TUNED_PATH.exists() else {}
    table = data.setdefault("devices", {}).setdefault(name, {})
    print("| rows | N | K | bf16 µs | default µs | best µs | best / bf16 | best config |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for rows in args.rows:
        for n, k in SHAPES[args.model]:
            base, ranked = run(rows, n, k, device)
            best_us, best = ranked[0]
            print(
                f"| {rows} | {n} | {k} | {base['bf16']:.1f} | {base['default']:.1f} | "
                f"{best_us:.1f} | {best_us / base['bf16']:.2f} | {best} |",
                flush=True,
            )
            table[wna16.tuned_key(rows, n, k, BITS, GROUP)] = best
    if args.write:
        data["about"] = "benchmarks/tune_wna16.py --write: " + wna16.TUNED_PATH.name
        data["fields"] = wna16.FIELDS
        wna16.TUNED_PATH.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
