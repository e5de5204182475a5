"""Time the MLA decode kernel's launch variants on one layer's decode (GPU).

One layer's latent decode attention (split kernel and merge; bf16, 576-wide entries of
kv_lora_rank 512 + rope 64, block size 64, blocks scattered over a cache larger than L2, each
timed call on blocks of its own, CUDA-graph replays), by default DeepSeek-V2-Lite's 16 heads
at batch 1 and a 4k context. First every tile variant (keys per tile x warps x pipeline stages
x heads per program) under today's split rule, then every split rule (keys per split) with the
fastest tile; prints µs, the split count and the latent bytes read per second of each, after
today's ``heron.kernels.mla_decode.LAUNCH``. The winner goes into ``MLADecodeLaunch``'s defaults
by hand, with the table that chose it in BENCHMARKS.md.

    python benchmarks/tune_mla_decode.py [--heads 16] [--batch 1] [--context 4096]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools

import torch
from tune_gemv import time_us

from heron.kernels import mla_decode as mla

LORA, ROPE, BLOCK = 512, 64, 64
L2_BYTES = 64 << 20  # more than an H200's L2: the copies of the latent cache together exceed it
TILES = list(itertools.product((16, 32, 64), (4, 8), (1, 2, 3), (16, 32, 64)))
KEYS_PER_SPLIT = (32, 64, 128, 256, 512)


def case_inputs(batch: int, context: int, heads: int):
    """Absorbed query, cache, block tables over disjoint blocks (enough copies that one call's
    blocks are out of L2 when it runs again), lengths."""
    blocks_per_req = -(-context // BLOCK)
    copies = max(2, -(-L2_BYTES // (batch * context * (LORA + ROPE) * 2)))
    num_blocks = copies * batch * blocks_per_req + 1
    cache = torch.randn(num_blocks, BLOCK, LORA + ROPE, dtype=torch.bfloat16, device="cuda")
    tables = (torch.randperm(num_blocks - 1, device="cuda") + 1).int()
    tables = tables.view(copies, batch, blocks_per_req).unbind(0)
    q = torch.randn(batch, heads, LORA + ROPE, dtype=torch.bfloat16, device="cuda")
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    return q, cache, tables, lens


def time_launch(launch: mla.MLADecodeLaunch, inputs, sms: int) -> tuple[float, int]:
    """(µs per call, the launch's split count) of ``launch``; inf where it does not compile
    or launch. ``mla.LAUNCH`` is back in place afterwards."""
    q, cache, tables, lens = inputs
    batch, heads, _ = q.shape
    default, mla.LAUNCH = mla.LAUNCH, launch
    try:
        splits = mla.choose_max_splits(batch, heads, int(lens.max()), sms)
        plan = mla.MLADecodePlan(torch.empty_like(lens), torch.empty_like(lens))
        mla.plan_mla_decode(lens, splits, plan)
        out = torch.empty(batch, heads, LORA, dtype=q.dtype, device="cuda")
        part_out = torch.empty(batch, heads, splits, LORA, device="cuda")
        part_lse = torch.empty(batch, heads, splits, device="cuda")

        def call(table):
            mla.mla_decode_attention(
                q, cache, table, lens, 0.1, LORA, plan, splits, out, part_out, part_lse
            )

        try:
            return time_us(call, tables), splits
        except Exception as e:  # out of shared memory / registers
            print(f"  {launch}: {type(e).__name__}")
            return float("inf"), splits
    finally:
        mla.LAUNCH = default


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=4096)
    args = parser.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    inputs = case_inputs(args.batch, args.context, args.heads)
    read = args.batch * args.context * (LORA + ROPE) * 2
    today = mla.LAUNCH
    print(f"{args.heads} heads, batch {args.batch}, context {args.context}; today: {today}")
    print("| keys/split | keys/tile | warps | stages | heads/program | splits | µs | GB/s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")

    def row(launch: mla.MLADecodeLaunch, name: str = "") -> float:
        us, splits = time_launch(launch, inputs, sms)
        print(
            f"| {launch.min_keys_per_split}{name} | {launch.block_n} | "
            f"{launch.num_warps or 'rule'} | {launch.num_stages} | {launch.block_h} | {splits} | "
            f"{us:.1f} | {read / us / 1e3:.0f} |",
            flush=True,
        )
        return us

    row(today, " (today)")
    tiles = [
        dataclasses.replace(today, block_n=n, num_warps=w, num_stages=s, block_h=h)
        for n, w, s, h in TILES
        if h <= max(16, args.heads)
    ]
    best = min(tiles, key=row)
    for keys in KEYS_PER_SPLIT:
        row(dataclasses.replace(best, min_keys_per_split=keys))


if __name__ == "__main__":
    main()
