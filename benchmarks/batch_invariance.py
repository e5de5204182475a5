"""What a batch-invariant mode would cost on the GPU: the same numerics for a token whether it
is decoded alone or verified in a block of ``1 + k`` (speculative decoding), at batch 1, on the
Qwen3-0.6B shape.

A decode step and a verification step of one row reduce in different orders in two places
today; everything else (norms, RoPE, the KV write, sampling) works row by row:

- the GEMV picks its launch configuration (K tile, split-K, dot or broadcast form) per row
  count padded to a power of two, so a row alone and the same row among ``1 + k`` are summed
  differently;
- attention runs a decode row through the split-KV decode kernel (as many splits as fill the
  GPU at that batch) and a verification row through the extend kernel (one program per 64
  queries and head, over the whole context).

A batch-invariant mode would give each weight shape one GEMV configuration of the dot form for
every row count up to 16 (the dot pads rows to 16, so a row's sums do not depend on the other
rows; here the configuration of 16 rows), and run verification rows through the decode kernel
as ``1 + k`` rows of consecutive lengths, every row split every ``--split-keys`` keys. This
times both ways, per product and per attention layer (CUDA-graph replays, weights and KV cold
in HBM), and prints µs per step.

    python benchmarks/batch_invariance.py [--k 4] [--contexts 256 1024 4096]
        [--split-keys 64 128 256]
"""

from __future__ import annotations

import argparse

import torch
import triton
from tune_decode_attention import case_inputs
from tune_gemv import SHAPES, time_us, triton_us

from heron.kernels import attention_decode as decode
from heron.kernels import gemv as g
from heron.kernels.attention_extend import paged_extend_attention
from heron.kernels.pdl import multiprocessor_count

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 28, 16, 8, 128  # Qwen3-0.6B
COLD_BYTES = 256 << 20  # weight copies per timed product: past the L2


def gemv_rows(k: int) -> list[tuple[str, int, list[float]]]:
    """Per product: its name, how often a step runs it, and µs of (decode today, decode
    invariant, verification today, verification invariant)."""
    device = torch.device("cuda")
    rows = []
    for name, n, kk, act in SHAPES["qwen3"]:
        copies = max(1, -(-COLD_BYTES // (n * kk * 2)))
        ws = [torch.randn(n, kk, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        invariant = g._config(16, n, kk, 2, device, act is not None)
        assert invariant.use_dot
        times = []
        for m in (1, 1 + k):
            x = torch.randn(m, 2 * kk if act else kk, device=device, dtype=torch.bfloat16)
            out = torch.empty(m, n, device=device, dtype=torch.bfloat16)
            today = g._config(g._m_pad(m), n, kk, 2, device, act is not None)
            times += [triton_us(act, today, x, ws, out), triton_us(act, invariant, x, ws, out)]
        rows.append((f"{name} {n}x{kk}", 1 if name == "lm_head" else LAYERS, times))
        del ws
        torch.cuda.empty_cache()
    return rows


def decode_us(q, cache, tables, lens, splits: int) -> float:
    """µs of one decode-kernel launch over ``q``'s rows at ``splits`` splits."""
    batch = q.shape[0]
    ws = {}
    if splits > 1:
        ws = dict(
            partial_out=torch.empty(batch, HEADS, splits, HEAD_DIM, device="cuda"),
            partial_lse=torch.empty(batch, HEADS, splits, device="cuda"),
            tickets=torch.zeros(
                decode.tickets_needed(batch, KV_HEADS, splits), dtype=torch.int32, device="cuda"
            ),
        )
    starts, out = torch.zeros_like(lens), torch.empty_like(q)

    def call(table):
        decode.paged_decode_attention(
            q, cache, table, starts, lens, HEAD_DIM**-0.5, None, out, splits, **ws
        )

    return time_us(call, tables)


def extend_us(q, cache, tables, kv_len: int) -> float:
    """µs of one extend-kernel launch: ``q``'s rows as one request's newest tokens."""
    starts = torch.zeros(1, dtype=torch.int32, device="cuda")
    query_start = torch.tensor([0, q.shape[0]], dtype=torch.int32, device="cuda")
    lens = torch.tensor([kv_len], dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)

    def call(table):
        paged_extend_attention(
            q, cache, table, starts, query_start, lens, q.shape[0], HEAD_DIM**-0.5, None, out
        )

    return time_us(call, tables)


def attention_rows(k: int, contexts: list[int], split_keys: list[int]) -> list[tuple]:
    """Per context: µs of one layer's decode today (and its splits), verification today, and
    per fixed split size the decode and the verification through the decode kernel."""
    sms = multiprocessor_count(torch.device("cuda"))
    rows = []
    for context in contexts:
        total = context + 1 + k  # the verification's last position sees them all
        q, cache, tables, _ = case_inputs(1, total, HEADS, KV_HEADS, HEAD_DIM)
        one = torch.tensor([context + 1], dtype=torch.int32, device="cuda")
        splits = decode.choose_num_splits(1, KV_HEADS, context + 1, sms)
        today = decode_us(q, cache, tables, one, splits)
        block_q = torch.randn(1 + k, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        verify_today = extend_us(block_q, cache, tables, total)
        block_tables = [t.expand(1 + k, -1).contiguous() for t in tables]
        block_lens = torch.arange(context + 1, total + 1, dtype=torch.int32, device="cuda")
        fixed = []
        for keys in split_keys:
            fixed.append(
                (
                    keys,
                    decode_us(q, cache, tables, one, triton.cdiv(context + 1, keys)),
                    decode_us(block_q, cache, block_tables, block_lens, triton.cdiv(total, keys)),
                )
            )
        rows.append((context, splits, today, verify_today, fixed))
        del cache
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=4, help="proposals a verification step checks")
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096])
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

    print(f"\n### Attention, batch 1, k = {k}: µs per layer\n")
    print(
        "| context | decode today (splits) | verification today (extend kernel) | "
        "keys per split | decode invariant | verification invariant (decode kernel) | "
        f"per step ({LAYERS} layers): decode, verification |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for context, splits, today, verify_today, fixed in attention_rows(
        k, args.contexts, args.split_keys
    ):
        for keys, dec, ver in fixed:
            print(
                f"| {context} | {today:.1f} ({splits}) | {verify_today:.1f} | {keys} | "
                f"{dec:.1f} | {ver:.1f} | {LAYERS * (dec - today):+.0f}, "
                f"{LAYERS * (ver - verify_today):+.0f} |"
            )


if __name__ == "__main__":
    main()
