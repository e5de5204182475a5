"""``heron bench kernel``: one decode kernel alone, with today's launch configuration, in µs
of device time and as a multiple of its bandwidth floor (the bytes it must read over the
measured copy bandwidth).

Kernels (``--kernel``):

- ``gemv``: the Triton GEMV of each decode-time linear of a shape (``--shape``) at ``--rows``
  rows, bf16 or (``--fp8``) FP8 weights with per-channel scales, next to the vendor's product
  (cuBLAS, or the FP8 tensor cores behind the one-launch activation quantisation);
- ``wna16``: the packed-int4 (W4A16) kernel of each decode-time linear of a shape but its LM
  head, AWQ-like (groups of 128, zero points), at ``--rows`` rows, next to cuBLAS on bf16;
- ``attention``: one layer's paged decode attention on Qwen3-0.6B and Gemma-3-1B layers
  (``--kv-cache-dtype fp8``: an E4M3 cache);
- ``mla``: one layer's latent decode attention, DeepSeek-V2-Lite's 16 heads;
- ``gdn``: a gated-delta-rule layer's decode, three launches against the fused one, on
  Qwen3.5-0.8B's and -35B-A3B's layers.

Operands are copies enough to overflow the L2 cache and every call reads its own, so each call
reads from HBM as in a real step; calls run as CUDA-graph replays (``device_time_us``). The
input builders and launches here are also what the tuners in ``benchmarks/`` sweep.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch

from heron.bench.measure import copy_bandwidth, device_time_us
from heron.bench.result import Metric

COLD_BYTES = 256 << 20  # well past an H200's L2 (60 MB)

# (name, N, K, fused gated activation) of each decode-time linear, per model shape.
GEMV_SHAPES = {
    "qwen3-0.6b": [
        ("qkv", 4096, 1024, None),
        ("o", 1024, 2048, None),
        ("gate_up", 6144, 1024, None),
        ("down", 1024, 3072, "silu"),
        ("lm_head", 151936, 1024, None),
    ],
    "qwen3-8b": [
        ("qkv", 6144, 4096, None),
        ("o", 4096, 4096, None),
        ("gate_up", 24576, 4096, None),
        ("down", 4096, 12288, "silu"),
        ("lm_head", 151936, 4096, None),
    ],
    "llama-3-8b": [
        ("qkv", 6144, 4096, None),
        ("o", 4096, 4096, None),
        ("gate_up", 28672, 4096, None),
        ("down", 4096, 14336, "silu"),
        ("lm_head", 128256, 4096, None),
    ],
    "qwen3.5-0.8b": [  # GDN and gated full-attention layers
        ("gdn_in", 8224, 1024, None),  # [qkv | z | b | a]
        ("attn_qkv", 5120, 1024, None),  # query and gate, k, v
        ("o", 1024, 2048, None),  # out_proj and o_proj
        ("gate_up", 7168, 1024, None),
        ("down", 1024, 3584, "silu"),
        ("lm_head", 248320, 1024, None),
    ],
    "deepseek-v2-lite": [
        ("q", 3072, 2048, None),
        ("kv_a", 576, 2048, None),
        ("o", 2048, 2048, None),
        ("shared_gate_up", 5632, 2048, None),
        ("shared_down", 2048, 2816, "silu"),
        ("dense_gate_up", 21888, 2048, None),
        ("dense_down", 2048, 10944, "silu"),
        ("lm_head", 102400, 2048, None),
    ],
    "gemma-3-1b": [
        ("qkv", 1536, 1152, None),
        ("o", 1152, 1024, None),
        ("gate_up", 13824, 1152, None),
        ("down", 1152, 6912, "gelu_tanh"),
        ("lm_head", 262144, 1152, None),
        # The down projection without its gated activation (applied by its own kernel), to
        # compare with the fused launch; the layer runs the fused one wherever the kernel
        # serves, so a tuned table keeps that one's winner for their shared key.
        ("down_plain", 1152, 6912, None),
    ],
}
# (name, batch, context, heads, KV heads, head_dim, window) of one decode-attention layer
ATTENTION_CASES = [
    ("qwen3 b256 ctx1024", 256, 1024, 16, 8, 128, None),
    ("gemma3 b64 ctx4096 full", 64, 4096, 4, 1, 256, None),
    ("gemma3 b64 ctx4096 win512", 64, 4096, 4, 1, 256, 512),
    ("gemma3 b1 ctx4096 full", 1, 4096, 4, 1, 256, None),
    ("gemma3 b1 ctx16384 full", 1, 16384, 4, 1, 256, None),
]
ATTENTION_BLOCK = 16
MLA_LORA, MLA_ROPE, MLA_BLOCK = 512, 64, 64
GDN_SHAPES = {"qwen3.5-0.8b": (16, 16), "qwen3.5-35b-a3b": (16, 32)}  # key, value heads
GDN_DIM, GDN_WIDTH, GDN_EPS = 128, 4, 1e-6


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kernel", choices=["gemv", "wna16", "attention", "mla", "gdn"], required=True
    )
    parser.add_argument(
        "--shape", choices=sorted(GEMV_SHAPES), default="qwen3-0.6b", help="of gemv"
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1], help="of gemv, mla and gdn")
    parser.add_argument("--fp8", action="store_true", help="gemv: FP8 weights")
    parser.add_argument(
        "--kv-cache-dtype", choices=["auto", "fp8"], default="auto", help="of attention"
    )
    parser.add_argument("--context", type=int, default=4096, help="of mla")


# GEMV ------------------------------------------------------------------------------------


def gemv_tensors(m: int, n: int, k: int, act: str | None, copies: int = 1, fp8: bool = False):
    """``x``, ``copies`` weights (bf16, or with ``fp8`` E4M3 with per-channel scales: pairs
    ``(q, scale)``) and ``out``."""
    from heron.layers.fp8 import quantize

    x = torch.randn(m, 2 * k if act else k, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    if fp8:
        ws = [quantize(w) for w in ws]
    return x, ws, torch.empty(m, n, device="cuda", dtype=torch.bfloat16)


def gemv_launch(x, w, out, cfg, act: str | None) -> None:
    """The GEMV over ``w``: a bf16 weight, or an FP8 ``(q, scale)``."""
    from heron.kernels import gemv as g

    q, scale = w if isinstance(w, tuple) else (w, None)
    g._launch(x, q, None, out, cfg, g.ACTIVATIONS[act] if act else 0, w_scale=scale)


def gemv_us(act: str | None, cfg, x, ws, out) -> float:
    """µs per weight (inf where the launch fails: out of shared memory or registers)."""
    try:
        return device_time_us(lambda w: gemv_launch(x, w, out, cfg, act), ws)
    except Exception:
        return float("inf")


def vendor_us(x, ws, out) -> float:
    """The plain product as layers run it past the GEMV, without a gated activation's input:
    cuBLAS (``torch.mm``) over bf16, FP8 tensor cores over FP8 (``scaled_mm`` with the
    one-launch activation quantisation)."""
    from heron.kernels.fp8_quant import quantize_rows
    from heron.layers.fp8 import scaled_mm

    if isinstance(ws[0], tuple):
        k = ws[0][0].shape[1]
        return device_time_us(lambda w: scaled_mm(x[:, :k], *w, quantize_rows=quantize_rows), ws)
    k = ws[0].shape[1]
    return device_time_us(lambda w: torch.mm(x[:, :k], w.t(), out=out), ws)


def gemv_metrics(args: argparse.Namespace, bandwidth: float) -> list[Metric]:
    from heron.kernels import gemv as g

    vendor = "FP8 tensor cores" if args.fp8 else "cuBLAS"
    metrics = []
    for m in args.rows:
        for name, n, k, act in GEMV_SHAPES[args.shape]:
            nbytes = n * k * (1 if args.fp8 else 2)
            x, ws, out = gemv_tensors(m, n, k, act, max(1, -(-COLD_BYTES // nbytes)), args.fp8)
            today = g._config(g._m_pad(m), n, k, 2, x.device, act is not None, fp8=args.fp8)
            floor = nbytes / bandwidth * 1e6
            what = f"{name} {n}x{k}, {m} rows" + (", FP8 weights" if args.fp8 else "")
            metrics.append(
                Metric(f"{args.shape} GEMV {what}", gemv_us(act, today, x, ws, out), "µs", floor)
            )
            metrics.append(
                Metric(f"{args.shape} {vendor} {what}", vendor_us(x, ws, out), "µs", floor)
            )
            del ws
            torch.cuda.empty_cache()
    return metrics


def wna16_metrics(args: argparse.Namespace, bandwidth: float) -> list[Metric]:
    """The W4A16 kernel per linear (its floor: the packed weight, scales and zero points) and
    cuBLAS over the bf16 weight (its floor: two bytes a weight)."""
    from heron.kernels.wna16 import wna16_linear
    from heron.layers.wna16 import quantize

    metrics = []
    for m in args.rows:
        for name, n, k, _ in GEMV_SHAPES[args.shape]:
            if name == "lm_head":  # not a Linear: stays in the model's dtype
                continue
            x, dense, out = gemv_tensors(m, n, k, None)
            packed = quantize(dense[0], 4, 128, True)
            nbytes = sum(t.numel() * t.element_size() for t in packed)
            ws = [tuple(t.clone() for t in packed) for _ in range(-(-COLD_BYTES // nbytes))]
            us = device_time_us(lambda p, x=x: wna16_linear(x, *p, 4, 128), ws)
            what = f"{name} {n}x{k}, {m} rows"
            floor = nbytes / bandwidth * 1e6
            metrics.append(Metric(f"{args.shape} W4A16 {what}", us, "µs", floor))
            dense = [dense[0].clone() for _ in range(-(-COLD_BYTES // (2 * n * k)))]
            floor = 2 * n * k / bandwidth * 1e6
            metrics.append(
                Metric(f"{args.shape} cuBLAS {what}", vendor_us(x, dense, out), "µs", floor)
            )
            del ws, dense
            torch.cuda.empty_cache()
    return metrics


# Decode attention ------------------------------------------------------------------------


def attention_inputs(batch, context, heads, kv_heads, head_dim, kv_dtype=torch.bfloat16, copies=5):
    """Query, cache, ``copies`` block tables over disjoint blocks, lengths. Each timed call
    reads its own table's blocks, so no call finds the K/V of the one before in L2."""
    blocks_per_req = -(-context // ATTENTION_BLOCK)
    num_blocks = copies * batch * blocks_per_req + 1
    cache = torch.randn(
        2, num_blocks, ATTENTION_BLOCK, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda"
    ).to(kv_dtype)
    tables = (torch.randperm(num_blocks - 1, device="cuda") + 1).int()
    tables = tables.view(copies, batch, blocks_per_req).unbind(0)
    q = torch.randn(batch, heads, head_dim, dtype=torch.bfloat16, device="cuda")
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    return q, cache, tables, lens


def split_workspace(rows: int, heads: int, kv_heads: int, head_dim: int, splits: int) -> dict:
    """The decode kernel's split workspace (none with one split), tickets zeroed."""
    from heron.kernels import attention_decode as decode

    if splits == 1:
        return {}
    return dict(
        partial_out=torch.empty(rows, heads, splits, head_dim, device="cuda"),
        partial_lse=torch.empty(rows, heads, splits, device="cuda"),
        tickets=torch.zeros(
            decode.tickets_needed(rows, kv_heads, splits), dtype=torch.int32, device="cuda"
        ),
    )


def attention_us(inputs, head_dim: int, window: int | None, splits: int) -> float:
    """µs of one decode-attention launch over ``inputs`` (:func:`attention_inputs`) at
    ``splits`` KV splits, with the module's launch shape."""
    from heron.kernels import attention_decode as decode

    q, cache, tables, lens = inputs
    batch, heads, _ = q.shape
    ws = split_workspace(batch, heads, cache.shape[3], head_dim, splits)
    starts, out = torch.zeros_like(lens), torch.empty_like(q)

    def call(table):
        decode.paged_decode_attention(
            q, cache, table, starts, lens, head_dim**-0.5, window, out, splits, **ws
        )

    return device_time_us(call, tables)


def attention_metrics(args: argparse.Namespace, bandwidth: float) -> list[Metric]:
    from heron.kernels import attention_decode as decode

    kv_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else torch.bfloat16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    metrics = []
    for name, batch, context, heads, kv_heads, head_dim, window in ATTENTION_CASES:
        inputs = attention_inputs(batch, context, heads, kv_heads, head_dim, kv_dtype)
        splits = decode.choose_num_splits(batch, kv_heads, context, sms, window)
        read = batch * min(context, window or context) * 2 * kv_heads * head_dim * kv_dtype.itemsize
        us = attention_us(inputs, head_dim, window, splits)
        name = f"decode attention {name}" + (", FP8 cache" if args.kv_cache_dtype == "fp8" else "")
        metrics.append(Metric(name, us, "µs", read / bandwidth * 1e6))
        del inputs
        torch.cuda.empty_cache()
    return metrics


# Latent (MLA) decode attention -----------------------------------------------------------


def mla_inputs(batch: int, context: int, heads: int):
    """Absorbed query, cache, block tables over disjoint blocks (enough copies that one
    call's blocks are out of L2 when it runs again), lengths."""
    blocks_per_req = -(-context // MLA_BLOCK)
    copies = max(2, -(-COLD_BYTES // (batch * context * (MLA_LORA + MLA_ROPE) * 2)))
    num_blocks = copies * batch * blocks_per_req + 1
    width = MLA_LORA + MLA_ROPE
    cache = torch.randn(num_blocks, MLA_BLOCK, width, dtype=torch.bfloat16, device="cuda")
    tables = (torch.randperm(num_blocks - 1, device="cuda") + 1).int()
    tables = tables.view(copies, batch, blocks_per_req).unbind(0)
    q = torch.randn(batch, heads, width, dtype=torch.bfloat16, device="cuda")
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    return q, cache, tables, lens


def mla_us(launch, inputs, sms: int) -> tuple[float, int]:
    """(µs per call, split count) of the MLA decode with ``launch`` (an ``MLADecodeLaunch``;
    the module's own is back in place afterwards); inf where it does not compile or launch."""
    from heron.kernels import mla_decode as mla

    q, cache, tables, lens = inputs
    batch, heads, _ = q.shape
    default, mla.LAUNCH = mla.LAUNCH, launch
    try:
        splits = mla.choose_max_splits(batch, heads, int(lens.max()), sms)
        plan = mla.MLADecodePlan(torch.empty_like(lens), torch.empty_like(lens))
        mla.plan_mla_decode(lens, splits, plan)
        out = torch.empty(batch, heads, MLA_LORA, dtype=q.dtype, device="cuda")
        part_out = torch.empty(batch, heads, splits, MLA_LORA, device="cuda")
        part_lse = torch.empty(batch, heads, splits, device="cuda")

        def call(table):
            mla.mla_decode_attention(
                q, cache, table, lens, 0.1, MLA_LORA, plan, splits, out, part_out, part_lse
            )

        try:
            return device_time_us(call, tables), splits
        except Exception:  # out of shared memory / registers
            return float("inf"), splits
    finally:
        mla.LAUNCH = default


def mla_metrics(args: argparse.Namespace, bandwidth: float) -> list[Metric]:
    from heron.kernels import mla_decode as mla

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    metrics = []
    for batch in args.rows:
        inputs = mla_inputs(batch, args.context, 16)
        us, splits = mla_us(mla.LAUNCH, inputs, sms)
        read = batch * args.context * (MLA_LORA + MLA_ROPE) * 2
        name = f"MLA decode, 16 heads, batch {batch}, context {args.context}"
        metrics.append(Metric(name, us, "µs", read / bandwidth * 1e6))
    return metrics


# Gated delta rule decode -----------------------------------------------------------------


def gdn_layer(hk: int, hv: int, rows: int, q: int = 1) -> dict[str, Any]:
    """One layer's inputs, weights and states (rows in slots 1..rows; slot 0 the null slot)."""
    bf16, dev, dim, width = torch.bfloat16, "cuda", GDN_DIM, GDN_WIDTH
    conv_dim = (2 * hk + hv) * dim
    zba = torch.randn(rows * q, hv * dim + 2 * hv, device=dev, dtype=bf16)
    kept = None
    if q > 1:
        kept = (
            torch.zeros(rows, q - 1, conv_dim, width - 1, device=dev, dtype=bf16),
            torch.zeros(rows, q - 1, hv, dim, dim, device=dev),
        )
    return dict(
        x=torch.randn(rows * q, conv_dim, device=dev, dtype=bf16),
        gate=zba[:, : hv * dim],
        a=zba[:, hv * dim : hv * dim + hv],
        b=zba[:, hv * dim + hv :],
        conv_weight=torch.randn(conv_dim, 1, width, device=dev, dtype=bf16)[:, 0] * 0.5,
        A_log=torch.rand(hv, device=dev).log().to(bf16),
        dt_bias=torch.randn(hv, device=dev, dtype=bf16),
        norm_weight=torch.randn(dim, device=dev, dtype=bf16),
        eps=GDN_EPS,
        conv_state=torch.randn(rows + 1, conv_dim, width - 1, device=dev, dtype=bf16),
        state=torch.randn(rows + 1, hv, dim, dim, device=dev) * 0.1,
        slots=torch.arange(1, rows + 1, device=dev, dtype=torch.int32),
        has_state=torch.ones(rows, device=dev, dtype=torch.bool),
        num_key_heads=hk,
        kept=kept,
    )


def gdn_three_launches(layer: dict[str, Any]) -> torch.Tensor:
    from heron.kernels.gated_delta import gdn_decode
    from heron.kernels.rmsnorm import gated_rms_norm

    rule = {k: v for k, v in layer.items() if k not in ("gate", "norm_weight", "eps")}
    out = gdn_decode(**rule)
    return gated_rms_norm(out, layer["gate"].view(out.shape), layer["norm_weight"], GDN_EPS)


def gdn_fused(layer: dict[str, Any]) -> torch.Tensor:
    from heron.kernels.gated_delta_fused import fused_gdn_decode

    return fused_gdn_decode(**layer)


def gdn_state_bytes(layer: dict[str, Any]) -> int:
    """Bytes of recurrent and conv state a step reads and writes (the kernels' floor)."""
    per_row = layer["state"][0].nbytes + layer["conv_state"][0].nbytes
    return 2 * layer["slots"].shape[0] * per_row


def gdn_metrics(args: argparse.Namespace, bandwidth: float) -> list[Metric]:
    metrics = []
    for name, (hk, hv) in GDN_SHAPES.items():
        for rows in args.rows:
            first = gdn_layer(hk, hv, rows)
            copies = max(2, math.ceil(COLD_BYTES / gdn_state_bytes(first)))
            layers = [first] + [gdn_layer(hk, hv, rows) for _ in range(copies - 1)]
            floor = gdn_state_bytes(first) / bandwidth * 1e6
            for how, launch in (("three launches", gdn_three_launches), ("fused", gdn_fused)):
                us = device_time_us(launch, layers)
                metrics.append(Metric(f"GDN decode {how}, {name}, {rows} rows", us, "µs", floor))
            del layers, first
            torch.cuda.empty_cache()
    return metrics


KERNELS = {
    "gemv": gemv_metrics,
    "wna16": wna16_metrics,
    "attention": attention_metrics,
    "mla": mla_metrics,
    "gdn": gdn_metrics,
}


def run(args: argparse.Namespace, config: Any = None) -> tuple[dict[str, Any], list[Metric]]:
    if not torch.cuda.is_available():
        raise ValueError("heron bench kernel times CUDA kernels: no CUDA device is visible")
    metrics = KERNELS[args.kernel](args, copy_bandwidth())
    keys = ("kernel", "shape", "rows", "fp8", "kv_cache_dtype", "context")
    return {k: getattr(args, k) for k in keys}, metrics
