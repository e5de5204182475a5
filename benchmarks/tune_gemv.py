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

    python benchmarks/tune_gemv.py --model gemma3 [--rows 1 2 4 8 16] [--workers 12]
        [--shapes down down_plain] [--fp8] [--write]

Models: qwen3 (Qwen3-0.6B), gemma3 (Gemma-3-1B), llama8b (Llama-3-8B / Mistral-7B), qwen3_5
(Qwen3.5-0.8B), deepseek_v2_lite (DeepSeek-V2-Lite's dense products).
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp

import torch

from heron.kernels import gemv as g
from heron.kernels.fp8_quant import quantize_rows
from heron.layers.fp8 import quantize, scaled_mm

# (name, N, K, fused gated activation) of each decode-time linear, per model shape.
SHAPES = {
    "qwen3": [
        ("qkv", 4096, 1024, None),
        ("o", 1024, 2048, None),
        ("gate_up", 6144, 1024, None),
        ("down", 1024, 3072, "silu"),
        ("lm_head", 151936, 1024, None),
    ],
    "llama8b": [
        ("qkv", 6144, 4096, None),
        ("o", 4096, 4096, None),
        ("gate_up", 28672, 4096, None),
        ("down", 4096, 14336, "silu"),
        ("lm_head", 128256, 4096, None),
    ],
    "qwen3_5": [  # Qwen3.5-0.8B: GDN and gated full-attention layers
        ("gdn_in", 8224, 1024, None),  # [qkv | z | b | a]
        ("attn_qkv", 5120, 1024, None),  # query and gate, k, v
        ("o", 1024, 2048, None),  # out_proj and o_proj
        ("gate_up", 7168, 1024, None),
        ("down", 1024, 3584, "silu"),
        ("lm_head", 248320, 1024, None),
    ],
    "deepseek_v2_lite": [
        ("q", 3072, 2048, None),
        ("kv_a", 576, 2048, None),
        ("o", 2048, 2048, None),
        ("shared_gate_up", 5632, 2048, None),
        ("shared_down", 2048, 2816, "silu"),
        ("dense_gate_up", 21888, 2048, None),
        ("dense_down", 2048, 10944, "silu"),
        ("lm_head", 102400, 2048, None),
    ],
    "gemma3": [
        ("qkv", 1536, 1152, None),
        ("o", 1152, 1024, None),
        ("gate_up", 13824, 1152, None),
        ("down", 1152, 6912, "gelu_tanh"),
        ("lm_head", 262144, 1152, None),
        # The down projection without its gated activation (applied by its own kernel), to
        # compare with the fused launch; the layer runs the fused one wherever the kernel
        # serves, so the table keeps that one's winner for their shared key.
        ("down_plain", 1152, 6912, None),
    ],
}


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


def tensors(m: int, n: int, k: int, act, copies: int = 1, fp8: bool = False):
    """``x``, ``copies`` weights (bf16, or with ``fp8`` E4M3 with per-channel scales: pairs
    ``(q, scale)``) and ``out``."""
    x = torch.randn(m, 2 * k if act else k, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    if fp8:
        ws = [quantize(w) for w in ws]
    return x, ws, torch.empty(m, n, device="cuda", dtype=torch.bfloat16)


def launch(x, w, out, cfg, act) -> None:
    """The kernel over ``w``: a bf16 weight, or an FP8 ``(q, scale)``."""
    q, scale = w if isinstance(w, tuple) else (w, None)
    g._launch(x, q, None, out, cfg, g.ACTIVATIONS[act] if act else 0, w_scale=scale)


def _compile(jobs) -> None:
    for m, n, k, act, cfg, fp8 in jobs:
        x, (w,), out = tensors(m, n, k, act, fp8=fp8)
        try:
            launch(x, w, out, g.GemvConfig(*cfg), act)
        except Exception:  # out of resources: the timing pass skips it
            pass
    torch.cuda.synchronize()


def time_us(launch, items) -> float:
    """µs per item of ``launch(item)`` over ``items`` (for a GEMV, cold copies of the weight),
    run eagerly once, then captured as one CUDA graph and replayed."""
    for item in items:
        launch(item)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for item in items:
            launch(item)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 10
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * len(items))


def triton_us(act, cfg, x, ws, out) -> float:
    """µs per weight (inf where the launch fails: out of shared memory or registers)."""
    try:
        return time_us(lambda w: launch(x, w, out, cfg, act), ws)
    except Exception:
        return float("inf")


def vendor_us(x, ws, out) -> float:
    """The plain product as layers run it past the kernel, without a gated activation's
    input: cuBLAS (``torch.mm``) over bf16, FP8 tensor cores over FP8 (``scaled_mm`` with
    the one-launch activation quantisation)."""
    if isinstance(ws[0], tuple):
        k = ws[0][0].shape[1]
        return time_us(lambda w: scaled_mm(x[:, :k], *w, quantize_rows=quantize_rows), ws)
    k = ws[0].shape[1]
    return time_us(lambda w: torch.mm(x[:, :k], w.t(), out=out), ws)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="gemma3")
    parser.add_argument("--rows", type=int, nargs="+", default=[1])
    parser.add_argument("--workers", type=int, default=12)
    parser.add_argument("--shapes", nargs="+", help="only these shapes (names as in SHAPES)")
    parser.add_argument("--write", action="store_true", help="store the winners in the table")
    parser.add_argument("--fp8", action="store_true", help="FP8 weights (their own table)")
    args = parser.parse_args()
    shapes = [s for s in SHAPES[args.model] if not args.shapes or s[0] in args.shapes]
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
        copies = max(1, -(-(256 << 20) // nbytes))
        x, ws, out = tensors(m, n, k, act, copies, args.fp8)
        today = g._config(g._m_pad(m), n, k, 2, x.device, act is not None, fp8=args.fp8)
        t_today = triton_us(act, today, x, ws, out)
        results = [(triton_us(act, c, x, ws, out), c) for c in candidates(m, n, k)]
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
