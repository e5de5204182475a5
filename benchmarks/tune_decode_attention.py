"""Time the paged decode-attention kernel's launch variants on decode shapes (GPU).

For Qwen3-0.6B-shaped layers (16 heads, 8 KV heads, head_dim 128) at large batches and
Gemma-3-1B-shaped ones (4 heads, 1 KV head, head_dim 256; full and 512-token window), times one
layer's decode attention (bf16, block size 16, blocks scattered over a cache larger than L2,
each timed call on blocks of its own, CUDA-graph replays) for each variant of keys per tile,
pipeline stages and warps, and prints µs and the KV bytes read per second.

With ``--splits`` it instead times batch-1 Gemma-3 layers at 4k and 16k tokens (and a Qwen3.5
full-attention layer at 4k: 8 heads, 2 KV heads) for each forced number of KV splits (the default launch shape), to check ``choose_num_splits`` at one request;
with ``--merge``, the same layers at 128 splits (a captured graph's count) for each number of
partial values a thread of the merging program loads per step.

With ``--batch64``, batch-64 Gemma-3 layers for each forced split count and launch variant.

With ``--kv-cache-dtype fp8`` the cache holds E4M3 (the default sweep only).

    python benchmarks/tune_decode_attention.py [--splits | --merge | --batch64]
        [--kv-cache-dtype fp8]
"""

from __future__ import annotations

import argparse
import itertools

import torch

from heron.bench.kernel import attention_inputs, split_workspace
from heron.bench.measure import device_time_us
from heron.kernels import attention_decode as decode

# (name, batch, context, heads, KV heads, head_dim, window)
CASES = [
    ("qwen3 b256 ctx1024", 256, 1024, 16, 8, 128, None),
    ("gemma3 b64 ctx4096 full", 64, 4096, 4, 1, 256, None),
    ("gemma3 b64 ctx4096 win512", 64, 4096, 4, 1, 256, 512),
    ("gemma3 b1 ctx16384 full", 1, 16384, 4, 1, 256, None),
]
VARIANTS = list(itertools.product((32, 64, 128), (2, 3), (4, 8)))  # keys, stages, warps
KV_DTYPE = torch.bfloat16  # the cache's; --kv-cache-dtype fp8 makes it E4M3


def tune_case(batch, context, heads, kv_heads, head_dim, window, sms, variants, splits=None):
    """[(µs, variant)] for each variant of one case (inf where it does not compile); ``splits``
    forces the split count. The module's launch defaults are back in place afterwards."""
    q, cache, tables, lens = attention_inputs(batch, context, heads, kv_heads, head_dim, KV_DTYPE)
    starts = torch.zeros_like(lens)  # tables hold each request's blocks from its first
    out = torch.empty_like(q)
    results = []
    defaults = (decode._BLOCK_N, decode._launch_shape)
    for variant in variants:  # None: the defaults
        decode._BLOCK_N, decode._launch_shape = defaults
        if variant is not None:
            block_n, stages, warps = variant
            decode._BLOCK_N = block_n
            decode._launch_shape = lambda *_, b=block_n, w=warps, s=stages: (b, w, s)
        # Chosen per variant: the count depends on the tile size.
        count = splits or decode.choose_num_splits(batch, kv_heads, context, sms, window)
        ws = split_workspace(batch, heads, kv_heads, head_dim, count)

        def call(table, count=count, ws=ws):
            decode.paged_decode_attention(
                q, cache, table, starts, lens, head_dim**-0.5, window, out, count, **ws
            )

        try:
            results.append((device_time_us(call, tables), variant))
        except Exception as e:  # out of shared memory / registers
            results.append((float("inf"), variant))
            print(f"  {variant}: {type(e).__name__}")
    decode._BLOCK_N, decode._launch_shape = defaults
    return results


# (model, context, heads, KV heads, window) of the batch-1 split sweep; head_dim 256
SPLIT_CASES = [
    ("gemma3", 4096, 4, 1, None),
    ("gemma3", 16384, 4, 1, None),
    ("gemma3", 16384, 4, 1, 512),
    ("qwen3.5", 4096, 8, 2, None),
]


def sweep_splits(sms: int) -> None:
    """µs of one batch-1 layer (Gemma-3's, Qwen3.5's full attention) for each forced split
    count."""
    counts = [1, 4, 8, 16, 32, 64, 128]
    print("| case | chosen | " + " | ".join(f"{c} splits µs" for c in counts) + " |")
    print("| --- | --- |" + " --- |" * len(counts))
    for model, context, heads, kv_heads, window in SPLIT_CASES:
        shape = (1, context, heads, kv_heads, 256, window, sms)
        chosen = decode.choose_num_splits(1, kv_heads, context, sms, window)
        times = [tune_case(*shape, [None], splits=c)[0][0] for c in counts]
        name = f"{model} b1 ctx{context} {'win' + str(window) if window else 'full'}"
        print(f"| {name} | {chosen} | " + " | ".join(f"{t:.1f}" for t in times) + " |")


def sweep_batch64(sms: int) -> None:
    """µs of one batch-64 Gemma-3 layer (4 k context, full and 512-token window) for each
    forced split count and launch variant: at 64 requests of one KV head the grid is 64
    programs a split, against 132 multiprocessors."""
    counts = [1, 2, 4, 8, 16]
    variants = [(64, 2, 8), (64, 3, 8), (64, 2, 4), (64, 3, 4), (32, 2, 8), (32, 3, 4)]
    splits = " | ".join(f"{c} splits µs" for c in counts)
    print(f"| case | (keys/tile, stages, warps) | {splits} |")
    print("| --- | --- |" + " --- |" * len(counts))
    for window in (None, 512):
        shape = (64, 4096, 4, 1, 256, window, sms)
        chosen = decode.choose_num_splits(64, 1, 4096, sms, window)
        name = f"gemma3 b64 ctx4096 {'win' + str(window) if window else 'full'} (today {chosen})"
        for variant in variants:
            times = [tune_case(*shape, [variant], splits=c)[0][0] for c in counts]
            print(f"| {name} | {variant} | " + " | ".join(f"{t:.1f}" for t in times) + " |")
        torch.cuda.empty_cache()


def sweep_merge(sms: int) -> None:
    """µs of one batch-1 Gemma-3 layer at 128 splits for each merge load size."""
    sizes = [16, 32, 64, 128]
    default = decode._MERGE_VALUES_PER_THREAD
    print("| case | " + " | ".join(f"{v} values µs" for v in sizes) + f" | (today: {default}) |")
    print("| --- |" + " --- |" * (len(sizes) + 1))
    for context in (4096, 16384):
        times = []
        for values in sizes:
            decode._MERGE_VALUES_PER_THREAD = values
            times.append(tune_case(1, context, 4, 1, 256, None, sms, [None], splits=128)[0][0])
        decode._MERGE_VALUES_PER_THREAD = default
        print(f"| gemma3 b1 ctx{context} full | " + " | ".join(f"{t:.1f}" for t in times) + " | |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sweeps = parser.add_mutually_exclusive_group()
    sweeps.add_argument("--splits", dest="sweep", action="store_const", const=sweep_splits,
                        help="sweep split counts at batch 1")  # fmt: skip
    sweeps.add_argument("--merge", dest="sweep", action="store_const", const=sweep_merge,
                        help="sweep merge load sizes at batch 1")  # fmt: skip
    sweeps.add_argument("--batch64", dest="sweep", action="store_const", const=sweep_batch64,
                        help="sweep splits x variants at batch 64")  # fmt: skip
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    args = parser.parse_args()
    global KV_DTYPE
    if args.kv_cache_dtype == "fp8":
        KV_DTYPE = torch.float8_e4m3fn
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if args.sweep is not None:
        args.sweep(sms)
        return
    print("| case | today µs (GB/s) | best (keys/tile, stages, warps) µs (GB/s) |")
    print("| --- | --- | --- |")
    for name, batch, context, heads, kv_heads, head_dim, window in CASES:
        read = batch * min(context, window or context) * 2 * kv_heads * head_dim
        read *= KV_DTYPE.itemsize
        shape = (batch, context, heads, kv_heads, head_dim, window, sms)
        today = tune_case(*shape, [None])[0]
        best = min(tune_case(*shape, VARIANTS))
        print(
            f"| {name} | {today[0]:.1f} ({read / today[0] / 1e3:.0f}) "
            f"| {best[1]} {best[0]:.1f} ({read / best[0] / 1e3:.0f}) |",
            flush=True,
        )
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
