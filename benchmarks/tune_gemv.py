"""Sweep the Triton GEMV's launch configurations for a model's decode shapes (GPU).

For each linear of the model (``N x K`` weights, bf16) and each row count, times every candidate
``GemvConfig`` with the weights cold in HBM (a CUDA graph cycles through enough copies of the
weight to overflow the L2 cache) and prints the winner next to the configuration
``heron.kernels.gemv`` picks today and to cuBLAS (what linears use where ``gemv.serves`` says
no), in µs and TB/s. ``--write`` stores the winners in the tuned table
(``heron/kernels/configs/gemv.json``) under this GPU's name; past ``gemv.RULE_MAX_M`` rows an
entry makes the linear take the kernel, so there only winners faster than the vendor's product
are stored. ``--fp8`` does the same over FP8 weights (per-channel scales), against the FP8
tensor cores, and stores under ``<GPU name> fp8``. Kernels are compiled first by worker processes in
parallel (Triton's on-disk cache hands them to the timing pass).

    python benchmarks/tune_gemv.py --model gemma-3-1b [--rows 1 2 4 8 16] [--workers 12]
        [--shapes down down_plain] [--fp8] [--write]

Models: the shapes of ``heron.bench.kernel.GEMV_SHAPES`` (qwen3-0.6b, gemma-3-1b, llama-3-8b,
qwen3.5-0.8b, deepseek-v2-lite's dense products); ``heron bench kernel --kernel gemv`` times
today's configuration alone.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp

import torch

from heron.bench.kernel import (
    COLD_BYTES,
    GEMV_SHAPES,
    gemv_launch,
    gemv_tensors,
    gemv_us,
    vendor_us,
)
from heron.kernels import gemv as g


def candidates(m: int, n: int, k: int) -> list[g.GemvConfig]:
    out = []
    if m == 1:  # broadcast-multiply programs of few columns
        for bn, bk, stages, split, w in itertools.product(
            (4, 8, 16, 32), (256, 512, 1024), (2, 3, 4), (1, 2, 4, 8), (4, 8)
        ):
            if k // split >= bk and bn * bk <= 16 * 1024:
                out.append(g.GemvConfig(False, bn, bk, w, stages, split))
    warps = (4, 8) if m > 16 else (4,)
    for bn, bk, stages, split, w in itertools.product(
        (16, 32, 64, 128), (64, 128, 256), (3, 4), (1, 2, 4, 8), warps
    ):
        if k // split >= bk and bn * bk <= 128 * 128:
            out.append(g.GemvConfig(True, bn, bk, w, stages, split))
    return out


def _compile(jobs) -> None:
    for m, n, k, act, cfg, fp8 in jobs:
        x, (w,), out = gemv_tensors(m, n, k, act, fp8=fp8)
        try:
            gemv_launch(x, w, out, g.GemvConfig(*cfg), act)
        except Exception:  # out of resources: the timing pass skips it
            pass
    torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(GEMV_SHAPES), default="gemma-3-1b")
    parser.add_argument("--rows", type=int, nargs="+", default=[1])
    parser.add_argument("--workers", type=int, default=12)
    parser.add_argument("--shapes", nargs="+", help="only these linears (names as in GEMV_SHAPES)")
    parser.add_argument("--write", action="store_true", help="store the winners in the table")
    parser.add_argument("--fp8", action="store_true", help="FP8 weights (their own table)")
    args = parser.parse_args()
    shapes = [s for s in GEMV_SHAPES[args.model] if not args.shapes or s[0] in args.shapes]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    jobs = []
    for m, (_, n, k, act) in itertools.product(args.rows, shapes):
        jobs += [(m, n, k, act, tuple(c), args.fp8) for c in candidates(m, n, k)]  # tuples pickle
    ctx = mp.get_context("spawn")
    with ctx.Pool(args.workers) as pool:
        pool.map(_compile, [jobs[i :: args.workers] for i in range(args.workers)])
    vendor = "FP8 tensor cores" if args.fp8 else "cuBLAS"
    print(
        f"| shape | rows | today: config, µs, TB/s | best: config, µs, TB/s | {vendor} µs, TB/s |"
    )
    print("| --- | --- | --- | --- | --- |")
    tuned: dict[tuple[int, int, int], g.GemvConfig] = {}
    for m, (name, n, k, act) in itertools.product(args.rows, shapes):
        nbytes = n * k * (1 if args.fp8 else 2)
        copies = max(1, -(-COLD_BYTES // nbytes))
        x, ws, out = gemv_tensors(m, n, k, act, copies, args.fp8)
        today = g._config(g._m_pad(m), n, k, 2, x.device, act is not None, fp8=args.fp8)
        t_today = gemv_us(act, today, x, ws, out)
        results = [(gemv_us(act, c, x, ws, out), c) for c in candidates(m, n, k)]
        t_best, best = min(results + [(t_today, today)])
        t_vendor = vendor_us(x, ws, out)
        print(
            f"| {name} {n}x{k} | {m} | {tuple(today)} {t_today:.1f} {nbytes / t_today / 1e6:.2f}"
            f" | {tuple(best)} {t_best:.1f} {nbytes / t_best / 1e6:.2f}"
            f" | {t_vendor:.1f} {nbytes / t_vendor / 1e6:.2f} |"
        )
        if m <= g.RULE_MAX_M or t_best < t_vendor:
            tuned.setdefault((g._m_pad(m), n, k), best)
        del ws
        torch.cuda.empty_cache()
    device = torch.cuda.get_device_name(0) + (g.FP8_TABLE if args.fp8 else "")
    print(f"\n{device}, {sms} SMs: {len(tuned)} winners")
    if args.write:
        tables = g.read_tuned()
        tables.setdefault(device, {}).update(tuned)
        g.write_tuned(tables)
        print(f"written to {g.TUNED_PATH}")


if __name__ == "__main__":
    main()
