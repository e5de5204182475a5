"""What a batch-invariant mode would cost on the GPU: the same numerics for a token whether it
is decoded alone or verified in a block of ``1 + k`` (speculative decoding), on the Qwen3-0.6B
shape.

A decode step and a verification step of one row reduce in different orders in two places;
everything else (norms, RoPE, the KV write, sampling) works row by row:

- the GEMV picks its launch configuration (K tile, split-K, dot or broadcast form) per row
  count padded to a power of two, so a row alone and the same row among ``1 + k`` are summed
  differently;
- attention splits a row's keys by a count chosen to fill the GPU (``choose_num_splits``), of
  a decode step's rows or of a verification step's tokens (the decode kernel runs uniform
  steps of up to 8 tokens a row, a program per token; before that, the extend kernel did).

A batch-invariant mode would give each weight shape one GEMV configuration of the dot form for
every row count up to 16 (the dot pads rows to 16, so a row's sums do not depend on the other
rows; here the configuration of 16 rows), and split every row's keys every ``--split-keys``
keys. This times both ways, per product (batch 1) and per attention layer (``--batches``), in
CUDA-graph replays with weights and KV cold in HBM, and prints µs per step; the attention
table also times verification on the extend kernel.

    python benchmarks/batch_invariance.py [--k 4] [--contexts 256 1024 4096] [--batches 1 8]
        [--split-keys 64 128 256]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton

from heron.bench.kernel import COLD_BYTES, GEMV_SHAPES, attention_inputs, gemv_us, split_workspace
from heron.bench.measure import device_time_us
from heron.kernels import attention_decode as decode
from heron.kernels import gemv as g
from heron.kernels.attention_extend import paged_extend_attention
from heron.kernels.pdl import multiprocessor_count

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 28, 16, 8, 128  # Qwen3-0.6B


def gemv_rows(k: int) -> list[tuple[str, int, list[float]]]:
    """Per product: its name, how often a step runs it, and µs of (decode today, decode
    invariant, verification today, verification invariant)."""
    device = torch.device("cuda")
    rows = []
    for name, n, kk, act in GEMV_SHAPES["qwen3-0.6b"]:
        copies = max(1, -(-COLD_BYTES // (n * kk * 2)))
        ws = [torch.randn(n, kk, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        invariant = g._config(16, n, kk, 2, device, act is not None)
        assert invariant.use_dot
        times = []
        for m in (1, 1 + k):
            x = torch.randn(m, 2 * kk if act else kk, device=device, dtype=torch.bfloat16)
            out = torch.empty(m, n, device=device, dtype=torch.bfloat16)
            today = g._config(g._m_pad(m), n, kk, 2, device, act is not None)
            times += [gemv_us(act, today, x, ws, out), gemv_us(act, invariant, x, ws, out)]
        rows.append((f"{name} {n}x{kk}", 1 if name == "lm_head" else LAYERS, times))
        del ws
        torch.cuda.empty_cache()
    return rows


def decode_us(q, cache, tables, lens, splits: int, queries: int = 1) -> float:
    """µs of one decode-kernel launch over ``q``'s rows (``queries`` tokens a request) at
    ``splits`` splits."""
    ws = split_workspace(q.shape[0], HEADS, KV_HEADS, HEAD_DIM, splits)
    starts, out = torch.zeros_like(lens), torch.empty_like(q)

    def call(table):
        decode.paged_decode_attention(
            q, cache, table, starts, lens, HEAD_DIM**-0.5, None, out, splits, **ws,
            queries_per_row=queries,
        )  # fmt: skip

    return device_time_us(call, tables)


def extend_us(q, cache, tables, lens, queries: int) -> float:
    """µs of one extend-kernel launch: ``queries`` newest tokens of each request."""
    starts = torch.zeros_like(lens)
    query_start = torch.arange(lens.shape[0] + 1, dtype=torch.int32, device="cuda") * queries
    out = torch.empty_like(q)

    def call(table):
        paged_extend_attention(
            q, cache, table, starts, query_start, lens, queries, HEAD_DIM**-0.5, None, out
        )

    return device_time_us(call, tables)


def attention_rows(k: int, batches: list[int], contexts: list[int], split_keys: list[int]):
    """Per batch and context, µs of one layer: decode (and its splits), verification on the
    extend kernel and on the decode kernel (and its splits), and per fixed split size the
    decode and the verification on the decode kernel."""
    sms = multiprocessor_count(torch.device("cuda"))
    rows = []
    for batch, context in itertools.product(batches, contexts):
        total = context + 1 + k  # a verification's last token sees them all
        q, cache, tables, _ = attention_inputs(batch, total, HEADS, KV_HEADS, HEAD_DIM)
        one = torch.full((batch,), context + 1, dtype=torch.int32, device="cuda")
        block_q = torch.randn(batch * (1 + k), HEADS, HEAD_DIM, device="cuda", dtype=q.dtype)
        block = torch.full((batch,), total, dtype=torch.int32, device="cuda")
        splits = decode.choose_num_splits(batch, KV_HEADS, context + 1, sms)
        verify_splits = decode.choose_num_splits(batch * (1 + k), KV_HEADS, total, sms)
        today = (
            decode_us(q, cache, tables, one, splits),
            extend_us(block_q, cache, tables, block, 1 + k),
            decode_us(block_q, cache, tables, block, verify_splits, 1 + k),
        )
        fixed = [
            (
                keys,
                decode_us(q, cache, tables, one, triton.cdiv(context + 1, keys)),
                decode_us(block_q, cache, tables, block, triton.cdiv(total, keys), 1 + k),
            )
            for keys in split_keys
        ]
        rows.append((batch, context, splits, verify_splits, today, fixed))
        del cache
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=4, help="proposals a verification step checks")
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="of attention")
    parser.add_argument("--split-keys", type=int, nargs="+", default=[64, 128, 256])
    args = parser.parse_args()
    k = args.k

    print(f"### GEMV, batch 1, k = {k}: µs per product (today / batch-invariant)\n")
    print("| product | per step | decode | verification |")
    print("| --- | --- | --- | --- |")
    sums = [0.0] * 4
    for name, count, t in gemv_rows(k):
        print(f"| {name} | {count} | {t[0]:.1f} / {t[1]:.1f} | {t[2]:.1f} / {t[3]:.1f} |")
        sums = [s + count * x for s, x in zip(sums, t)]
    print(
        f"| all, µs per step | | {sums[0]:.0f} / {sums[1]:.0f} (+{sums[1] - sums[0]:.0f})"
        f" | {sums[2]:.0f} / {sums[3]:.0f} (+{sums[3] - sums[2]:.0f}) |"
    )

    print(f"\n### Attention, k = {k}: µs per layer\n")
    print(
        "| batch | context | decode (splits) | verification: extend kernel / decode kernel "
        "(splits) | keys per split | invariant decode | invariant verification | "
        f"invariant against decode kernels, per step ({LAYERS} layers): decode, verification |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = attention_rows(k, args.batches, args.contexts, args.split_keys)
    for batch, context, splits, verify_splits, today, fixed in rows:
        dec, ext, ver = today
        for keys, inv_dec, inv_ver in fixed:
            print(
                f"| {batch} | {context} | {dec:.1f} ({splits}) | {ext:.1f} / {ver:.1f} "
                f"({verify_splits}) | {keys} | {inv_dec:.1f} | {inv_ver:.1f} | "
                f"{LAYERS * (inv_dec - dec):+.0f}, {LAYERS * (inv_ver - ver):+.0f} |"
            )


if __name__ == "__main__":
    main()
