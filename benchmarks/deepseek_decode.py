"""Decode on DeepSeek shapes with latent attention (MLA) and DeepSeek MoE, Heron against HF
transformers (GPU, bf16, CUDA graphs, random weights through ``load_format="dummy"``).

Shapes (``--shape``):

- ``v2-lite``: DeepSeek-V2-Lite: 27 layers, hidden 2048, 16 heads, kv_lora_rank 512, rope 64,
  nope 128, v 128; the first layer dense (width 10944), then 64 routed experts top-6 of width
  1408 plus 2 shared; vocab 102400.
- ``v3-5l``: DeepSeek-V3's layer shape with 5 layers (1 dense + 4 MoE): hidden 7168, 128
  heads, q_lora 1536, kv_lora 512, 256 experts top-8 of width 2048, 1 shared, 8 groups top-4,
  sigmoid routing; Heron only (HF would need a second copy of its ~95 GB).

For each (context x batch) case: decode ms per step, measured as in ``gpu_decode.py``, and its
multiple of the bandwidth floor: (weight bytes the step reads + latent cache bytes) / measured
copy bandwidth, where the experts read per MoE layer are those the step's routing touches
(counted as in ``moe_decode.py``). HF runs the batch-1 cases through its plain ``generate``
(its continuous batching does not take DeepSeek-V2). Then Heron's throughput on
workload A of ``gpu_decode.py`` (256 requests, in/out uniform in [100, 1024]) unless
``--skip-throughput``. ``--quantization fp8`` (FP8 projections and experts; ``kv_b_proj``,
which the latent operator absorbs, stays bf16) applies to Heron only; the floor counts its
bytes (one per FP8 element; routers and the LM head stay bf16). With
``--tensor-parallel-size`` Heron's floors are one GPU's share (the latent cache is whole on
each).

    python benchmarks/deepseek_decode.py [--shape v2-lite] [--skip-hf] [--skip-throughput]
        [--new-tokens 64] [--cases 4096x1 4096x64] [--quantization fp8]
        [--tensor-parallel-size 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from heron import LLM

from gpu_decode import (
    copy_bandwidth,
    heron_decode_ms,
    hf_generate_ms,
    hf_model,
    save_config_only,
    workload_a,
)
from moe_decode import count_touched_experts

COMMON = dict(
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    first_k_dense_replace=1,
    max_position_embeddings=16384,
    tie_word_embeddings=False,
)
SHAPES = {
    "v2-lite": (
        "DeepseekV2",
        dict(
            COMMON,
            hidden_size=2048,
            num_hidden_layers=27,
            intermediate_size=10944,
            num_attention_heads=16,
            num_key_value_heads=16,
            q_lora_rank=None,
            n_routed_experts=64,
            num_experts_per_tok=6,
            moe_intermediate_size=1408,
            n_shared_experts=2,
            topk_method="greedy",
            routed_scaling_factor=1.0,
            vocab_size=102400,
        ),
    ),
    "v3-5l": (
        "DeepseekV3",
        dict(
            COMMON,
            hidden_size=7168,
            num_hidden_layers=5,
            intermediate_size=18432,
            num_attention_heads=128,
            num_key_value_heads=128,
            q_lora_rank=1536,
            n_routed_experts=256,
            num_experts_per_tok=8,
            moe_intermediate_size=2048,
            n_shared_experts=1,
            n_group=8,
            topk_group=4,
            routed_scaling_factor=2.5,
            vocab_size=129280,
            num_mtp_layers=0,
        ),
    ),
}
CASES = [(4096, 1), (4096, 64)]  # (context, batch)
WORKLOAD_A_BATCH, WORKLOAD_A_LEN = 256, 2048  # its requests (all may decode at once), longest


def floor_ms(
    c: dict,
    batch: int,
    context: int,
    experts_read: float,
    bandwidth: float,
    weight_bytes: int = 2,
    tp: int = 1,
) -> float:
    """Per-step lower bound of one GPU of ``tp``: attention, dense and shared MLPs, routers,
    ``experts_read`` routed experts per MoE layer, the LM head (not the embedding rows), and
    every request's bf16 latent cache (``kv_lora_rank + rope`` values per token per layer), at
    full bandwidth; ``weight_bytes`` per element of the projections and experts (``kv_b_proj``,
    routers and the LM head are bf16). A rank holds its share of the heads, the experts'
    widths and the vocabulary, and the whole of ``q_a_proj``, ``kv_a_proj_with_mqa``, the
    routers and the latent cache."""
    d, h, lora, rope = c["hidden_size"], c["num_attention_heads"], c["kv_lora_rank"], 64
    nope, v, q_lora = c["qk_nope_head_dim"], c["v_head_dim"], c["q_lora_rank"]
    q_a = 0 if q_lora is None else d * q_lora
    q = d * h * (nope + rope) if q_lora is None else q_lora * h * (nope + rope)
    kv_b = lora * h * (nope + v)
    layers, dense = c["num_hidden_layers"], c["first_k_dense_replace"]
    expert = 3 * d * c["moe_intermediate_size"]
    experts = (experts_read + c["n_shared_experts"]) * expert
    mlps = dense * 3 * d * c["intermediate_size"] + (layers - dense) * experts
    routers = (layers - dense) * c["n_routed_experts"] * d
    sharded = weight_bytes * (layers * (q + h * v * d) + mlps) + 2 * (
        layers * kv_b + c["vocab_size"] * d
    )
    replicated = weight_bytes * layers * (q_a + d * (lora + rope)) + 2 * routers
    latent = batch * context * layers * (lora + rope) * 2
    return (sharded / tp + replicated + latent) / bandwidth * 1e3


def main() -> None:
    import transformers as tf

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="v2-lite")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--cases", nargs="+", help="CONTEXTxBATCH, e.g. 4096x64")
    parser.add_argument("--quantization", choices=["fp8"], default=None)
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    args = parser.parse_args()
    tp = args.tensor_parallel_size
    cases = [tuple(map(int, c.split("x"))) for c in args.cases] if args.cases else CASES
    family, shape = SHAPES[args.shape]
    bandwidth = copy_bandwidth()
    weight_bytes = 1 if args.quantization else 2
    print(
        f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; shape {args.shape}; Heron weights "
        f"{args.quantization or 'bf16'}, tensor parallel {tp} (floors per GPU)"
    )
    touched: dict[int, float] = {}

    def header() -> None:
        print("| engine | context | batch | ms/step | experts touched | floor ms | x floor |")
        print("| --- | --- | --- | --- | --- | --- | --- |")

    def row(name: str, context: int, batch: int, ms: float) -> None:
        # Rows as they come: Heron's stand even if the HF baseline fails.
        floor = floor_ms(
            shape, batch, context + args.new_tokens // 2, touched[batch], bandwidth,
            weight_bytes if name == "Heron" else 2, tp if name == "Heron" else 1,
        )  # fmt: skip
        print(
            f"| {name} | {context} | {batch} | {ms:.3f} | {touched[batch]:.1f} | {floor:.3f} | "
            f"{ms / floor:.2f}x |"
        )

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        config = getattr(tf, f"{family}Config")(**shape)
        save_config_only(config, f"{family}ForCausalLM", path)
        longest = max(context for context, _ in cases) + args.new_tokens
        batches = sorted({b for _, b in cases})
        graph_batch = max(batches)
        if not args.skip_throughput:
            longest, graph_batch = max(longest, WORKLOAD_A_LEN), max(graph_batch, WORKLOAD_A_BATCH)
        make_llm = lambda **eager: LLM(
            str(path),
            load_format="dummy",
            max_model_len=longest,
            cuda_graph_max_bs=graph_batch,
            quantization=args.quantization,
            tensor_parallel_size=tp,
            **eager,
        )
        counts = count_touched_experts(make_llm, batches)
        touched.update((b, statistics.mean(c)) for b, c in counts.items())
        llm = make_llm()
        for b in batches:  # compiles the kernel variants each batch's steps need
            heron_decode_ms(llm, [[3 + i] * 256 for i in range(b)], 8)
        header()
        for context, batch in cases:
            prompts = [[(7 + i + j) % 100000 + 2 for j in range(context)] for i in range(batch)]
            row("Heron", context, batch, heron_decode_ms(llm, prompts, args.new_tokens)[0])
        if not args.skip_throughput:
            tps = workload_a(llm, shape["vocab_size"])
            print(
                f"\nHeron, workload A (256 requests, in/out uniform in [100, 1024]): {tps:,.0f} tok/s"
            )
        llm.engine.shutdown()
        del llm
        torch.cuda.empty_cache()
        if args.skip_hf or args.shape != "v2-lite":
            return
        model = hf_model(path, "dummy")
        print()
        header()
        for context, batch in cases:
            if batch == 1:
                prompt = [[(7 + j) % 100000 + 2 for j in range(context)]]
                ms = hf_generate_ms(model, prompt[0], args.new_tokens)
                row("HF transformers (generate)", context, 1, ms)


if __name__ == "__main__":
    main()
