"""Decode on a Qwen3-30B-A3B-shaped MoE model with random weights (GPU, bf16, CUDA graphs).

The shape: hidden 2048, 48 layers, 32 heads / 4 KV heads of dim 128, every layer a sparse MoE
block of 128 experts of width 768 with top-8 routing (``norm_topk_prob``), vocab 151936,
untied. Weights are ``load_format="dummy"`` (nothing is written but config.json). For batch 1
and batch 64 (128-token prompts): decode ms per step, measured as in ``gpu_decode.py``, and its
multiple of the bandwidth floor, (weight bytes the step must read + KV bytes) / measured copy
bandwidth, where the experts read are those the step's routing touches: counted on an eager
engine of their own with hooks on the routers, and printed (distinct experts per MoE layer per
decode step). ``--hf`` adds HF transformers' continuous batching on the same config (its own
random init; slow: its experts loop on the host). ``--quantization fp8`` (FP8 attention
projections and experts) and ``--kv-cache-dtype fp8`` apply to Heron only; the floor counts
their bytes (one per FP8 element; routers and the LM head stay bf16).

    python benchmarks/moe_decode.py [--new-tokens 128] [--batches 1 64] [--hf]
        [--quantization fp8] [--kv-cache-dtype fp8]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from heron import LLM, SamplingParams
from heron.distributed.executor import TensorParallelRunner
from heron.layers.routing import TopKRouter

from gpu_decode import (
    add_fp8_args,
    copy_bandwidth,
    element_bytes,
    heron_decode_ms,
    hf_decode_ms,
    hf_model,
    save_config_only,
)

QWEN3_30B_A3B = dict(
    hidden_size=2048,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    vocab_size=151936,
    tie_word_embeddings=False,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
)
PROMPT_LEN = 128


def prompts(batch: int) -> list[list[int]]:
    return [[3 + i] * PROMPT_LEN for i in range(batch)]


def touched_experts(llm: LLM, batch: int, steps: int = 8) -> list[int]:
    """Distinct experts of each MoE layer in each step over exactly ``batch`` tokens (the
    decode steps), from hooks on rank 0's routers (every rank routes alike). The engine must
    run eagerly: replayed graphs skip hooks."""
    runner = llm.engine.runner
    if runner.graphs is not None:
        raise ValueError("count experts on an engine built with enforce_eager=True")
    counts: list[int] = []

    def hook(module, inputs, output):
        if output[1].shape[0] == batch:
            counts.append(output[1].unique().numel())

    model = runner.local.model if isinstance(runner, TensorParallelRunner) else runner.model
    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, TopKRouter)]
    try:
        params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
        llm.generate(prompts(batch), params, use_tqdm=False)
    finally:
        for h in handles:
            h.remove()
    return counts


def count_touched_experts(
    make_llm: Callable[..., LLM], batches: Iterable[int]
) -> dict[int, list[int]]:
    """:func:`touched_experts` of each batch, on an engine ``make_llm(enforce_eager=True)``
    built for the count and shut down, its memory freed, before the caller builds the timed
    one (a tensor-parallel engine has one at a time, and its workers replay their own
    graphs)."""
    llm = make_llm(enforce_eager=True)
    try:
        return {b: touched_experts(llm, b) for b in batches}
    finally:
        llm.engine.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def floor_ms(
    batch: int,
    context: int,
    experts_read: float,
    bandwidth: float,
    weight_bytes: int = 2,
    kv_bytes: int = 2,
) -> float:
    """Per-step lower bound: attention, router and LM-head weights, ``experts_read`` experts per
    layer, and every request's KV history, at full bandwidth (``weight_bytes`` per attention or
    expert weight element, ``kv_bytes`` per cached element; routers and LM head bf16)."""
    c = QWEN3_30B_A3B
    d, h, kv, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], 128
    layers = c["num_hidden_layers"]
    attention = d * (h + 2 * kv) * hd + h * hd * d
    expert = 3 * d * c["moe_intermediate_size"]
    quantised = weight_bytes * layers * (attention + experts_read * expert)
    weights = quantised + 2 * (layers * c["num_experts"] * d + c["vocab_size"] * d)
    cache = batch * context * layers * 2 * kv * hd * kv_bytes
    return (weights + cache) / bandwidth * 1e3


def main() -> None:
    import transformers as tf

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--hf", action="store_true", help="also run HF transformers")
    add_fp8_args(parser)
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    new, batches = args.new_tokens, args.batches
    rows: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        save_config_only(tf.Qwen3MoeConfig(**QWEN3_30B_A3B), "Qwen3MoeForCausalLM", path)
        make_llm = lambda **eager: LLM(
            str(path),
            load_format="dummy",
            max_model_len=PROMPT_LEN + new + 16,
            cuda_graph_max_bs=max(batches),
            quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
            **eager,
        )
        touched = count_touched_experts(make_llm, batches)
        llm = make_llm()
        warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        for b in batches:  # compiles the kernel variants each batch's steps need
            llm.generate(prompts(b), warm, use_tqdm=False)
        rows["Heron"] = [heron_decode_ms(llm, prompts(b), new)[0] for b in batches]
        del llm
        torch.cuda.empty_cache()
        if args.hf:
            hf = hf_model(path, "dummy")
            rows["HF transformers CB"] = [hf_decode_ms(hf, prompts(b), new)[0] for b in batches]
    print(
        f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; Heron weights "
        f"{args.quantization or 'bf16'}, KV cache {args.kv_cache_dtype}"
    )
    floors = []
    for b in batches:
        counts = touched[b]
        mean = statistics.mean(counts)
        print(
            f"batch {b}: experts touched per MoE layer per decode step: mean {mean:.1f}, "
            f"min {min(counts)}, max {max(counts)} of {QWEN3_30B_A3B['num_experts']} "
            f"({len(counts)} layer-steps)"
        )
        floors.append(floor_ms(b, PROMPT_LEN + new // 2, mean, bandwidth, *element_bytes(args)))
    header = " | ".join(f"batch {b}: ms/step (× floor {f:.2f} ms)" for b, f in zip(batches, floors))
    print(f"| engine | {header} |")
    print("| --- |" + " --- |" * len(batches))
    for name, times in rows.items():
        cells = " | ".join(f"{t:.3f} ({t / f:.2f}×)" for t, f in zip(times, floors))
        print(f"| {name} | {cells} |")


if __name__ == "__main__":
    main()
