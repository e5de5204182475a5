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

from heron.bench.kernel import MLA_LORA, MLA_ROPE, mla_inputs, mla_us
from heron.kernels import mla_decode as mla

TILES = list(itertools.product((16, 32, 64), (4, 8), (1, 2, 3), (16, 32, 64)))
KEYS_PER_SPLIT = (32, 64, 128, 256, 512)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=4096)
    args = parser.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    inputs = mla_inputs(args.batch, args.context, args.heads)
    read = args.batch * args.context * (MLA_LORA + MLA_ROPE) * 2
    today = mla.LAUNCH
    print(f"{args.heads} heads, batch {args.batch}, context {args.context}; today: {today}")
    print("| keys/split | keys/tile | warps | stages | heads/program | splits | µs | GB/s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")

    def row(launch: mla.MLADecodeLaunch, name: str = "") -> float:
        us, splits = mla_us(launch, inputs, sms)
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
