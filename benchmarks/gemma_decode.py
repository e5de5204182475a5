"""Decode on a Gemma-3-1B-shaped model at long context, Heron against HF transformers (GPU).

A random-weight model with Gemma 3 1B's shape (hidden 1152, 26 layers: five sliding-window
layers then one full layer, repeating; 4 heads, 1 KV head, head_dim 256, intermediate 6912,
vocab 262144, window 512, RoPE bases 10,000 local / 1,000,000 global, tied embeddings, bf16).
For each context (4k and 16k tokens): decode ms per step at batch 1 and at batch 64 (4k only:
64 requests of 16k do not fit the HF baseline), measured as in ``gpu_decode.py`` (per request,
(last token time - first token time) / (tokens - 1)), and its multiple of the bandwidth floor:
(weight bytes + KV bytes read) / measured copy bandwidth, where a sliding layer reads at most
its window and a full layer the whole context. Then, in a separate run, the share of a batch-64
step in which the GPU waits for the host (see ``gpu_decode.heron_host_idle``).

    python benchmarks/gemma_decode.py [--skip-hf] [--new-tokens 64] [--cases 4096x8 ...]
        [--load-format dummy] [--quantization fp8] [--kv-cache-dtype fp8]
        [--tensor-parallel-size 2]

``--cases`` replaces the (context x batch) cases; the idle share is measured when 4096x64 is
among them. ``--load-format dummy`` is as in ``gpu_decode.py`` (no checkpoint is written), and
so are the FP8 switches (Heron only; the floors count their bytes) and
``--tensor-parallel-size`` (the floors are one GPU's share; its one KV head is on every GPU;
HF, on one GPU, is not run).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from heron import LLM, SamplingParams

from gpu_decode import (
    add_fp8_args,
    copy_bandwidth,
    element_bytes,
    heron_decode_ms,
    heron_host_idle,
    hf_decode_ms,
    hf_model,
    print_case_table,
    save_config_only,
    save_random_checkpoint,
)

GEMMA3_1B = dict(
    hidden_size=1152,
    num_hidden_layers=26,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=256,
    intermediate_size=6912,
    vocab_size=262144,
    sliding_window=512,
    max_position_embeddings=32768,
    tie_word_embeddings=True,
)
CASES = [(4096, 1), (4096, 64), (16384, 1)]  # (context, batch)


def build_model(path: Path, load_format: str) -> None:
    import transformers as tf

    config = tf.Gemma3TextConfig(**GEMMA3_1B)  # defaults: 5 sliding : 1 full, bases 10k / 1M
    if load_format == "dummy":
        save_config_only(config, "Gemma3ForCausalLM", path)
        return
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = tf.Gemma3ForCausalLM(config).to(torch.bfloat16)
    save_random_checkpoint(model, path)


def floor_ms(
    batch: int,
    context: int,
    bandwidth: float,
    layer_types: list[str],
    weight_bytes: int = 2,
    kv_bytes: int = 2,
    tp: int = 1,
) -> float:
    """Per-step lower bound of one GPU of ``tp``: its share of the weights, and of the KV heads
    (each rank holds the one KV head whole)."""
    c = GEMMA3_1B
    d, h, kv, hd = (
        c["hidden_size"],
        c["num_attention_heads"],
        c["num_key_value_heads"],
        c["head_dim"],
    )
    per_layer = d * (h + 2 * kv) * hd + h * hd * d + 3 * d * c["intermediate_size"]
    weights = weight_bytes * len(layer_types) * per_layer + 2 * c["vocab_size"] * d
    read = sum(
        min(context, c["sliding_window"]) if t == "sliding_attention" else context
        for t in layer_types
    )
    kv_share = max(kv // tp, 1)
    return (weights / tp + batch * read * 2 * kv_share * hd * kv_bytes) / bandwidth * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument(
        "--hf-max-batch", type=int, default=64, help="HF runs only the cases up to this batch"
    )
    parser.add_argument(
        "--cases", nargs="+", default=[f"{c}x{b}" for c, b in CASES], help="CONTEXTxBATCH"
    )
    parser.add_argument("--load-format", choices=["auto", "dummy"], default="auto")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    add_fp8_args(parser)
    args = parser.parse_args()
    tp = args.tensor_parallel_size
    cases = [tuple(map(int, case.split("x"))) for case in args.cases]
    bandwidth = copy_bandwidth()
    new = args.new_tokens
    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        build_model(path, args.load_format)
        llm = LLM(
            str(path),
            max_model_len=max(c for c, _ in cases) + new + 16,
            load_format=args.load_format,
            quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
            tensor_parallel_size=tp,
        )
        layer_types = llm.engine.model_config.hf_config.layer_types
        prompts = lambda context, batch: [[3 + i] * context for i in range(batch)]
        # Warm-up: a short run of every case first, so that one-time work (first replays,
        # allocations, the garbage of loading) falls outside the measured runs.
        warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        for c, b in cases:
            llm.generate(prompts(c, b), warm, use_tqdm=False)
        results["Heron"] = [heron_decode_ms(llm, prompts(c, b), new)[0] for c, b in cases]
        # In a run of its own (its CUDA events add host work): how much of a batch-64 step the
        # GPU waits for the host.
        idle = heron_host_idle(llm, prompts(4096, 64), new)[1] if (4096, 64) in cases else None
        del llm
        torch.cuda.empty_cache()
        if not args.skip_hf and tp == 1:  # the floors are per GPU
            hf = hf_model(path, args.load_format)
            results["HF transformers CB"] = [
                hf_decode_ms(hf, prompts(c, b), new)[0] if b <= args.hf_max_batch else float("nan")
                for c, b in cases
            ]
    sizes = element_bytes(args)
    floors = [floor_ms(b, c + new // 2, bandwidth, layer_types, *sizes, tp) for c, b in cases]
    print(
        f"Heron weights {args.quantization or 'bf16'}, KV cache {args.kv_cache_dtype}, "
        f"tensor parallel {tp} (floors per GPU); copy bandwidth {bandwidth / 1e12:.2f} TB/s"
    )
    print_case_table(cases, floors, results)
    if idle is not None:
        print(f"\nHeron, 4k context, batch 64: the GPU waits for the host {idle:.1%} of a step")


if __name__ == "__main__":
    main()
