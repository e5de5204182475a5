"""Decode on a DeepSeek-V2-Lite-shaped model with latent attention (MLA), Heron against HF
transformers (GPU).

Random weights (``--load-format dummy`` by default: config.json only, Heron makes them on the
GPU) with V2-Lite's attention and stack: 27 layers, hidden 2048, 16 heads, kv_lora_rank 512,
rope 64, nope 128, v 128, vocab 102400, bf16, CUDA graphs. Heron has no DeepSeek MoE yet, so
every layer's MLP is the dense one of V2-Lite's first layer (width 10944): the floor below is
that of the model as built. For each (context x batch) case: decode ms per step, measured as in
``gpu_decode.py``, and its multiple of the bandwidth floor (weight bytes + latent cache bytes
read per step) / measured copy bandwidth. HF runs the batch-1 case only (its eager MLA
decompresses every cached latent each step).

    python benchmarks/deepseek_decode.py [--skip-hf] [--new-tokens 64] [--cases 4096x1 ...]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from heron import LLM

from gpu_decode import (
    copy_bandwidth,
    heron_decode_ms,
    hf_decode_ms,
    hf_model,
    save_config_only,
    save_random_checkpoint,
)

V2_LITE_DENSE = dict(
    hidden_size=2048,
    num_hidden_layers=27,
    first_k_dense_replace=27,
    intermediate_size=10944,
    num_attention_heads=16,
    num_key_value_heads=16,
    q_lora_rank=None,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    vocab_size=102400,
    max_position_embeddings=16384,
    tie_word_embeddings=False,
)
CASES = [(4096, 1), (4096, 64)]  # (context, batch)


def build_model(path: Path, load_format: str) -> None:
    import transformers as tf

    config = tf.DeepseekV2Config(**V2_LITE_DENSE)
    if load_format == "dummy":
        save_config_only(config, "DeepseekV2ForCausalLM", path)
        return
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = tf.DeepseekV2ForCausalLM(config).to(torch.bfloat16)
    save_random_checkpoint(model, path)


def floor_ms(batch: int, context: int, bandwidth: float) -> float:
    """Every weight once (the LM head, not the embedding rows) plus every request's latent
    cache (576 bf16 values per token per layer), at full speed."""
    c = V2_LITE_DENSE
    d, h, lora, rope = c["hidden_size"], c["num_attention_heads"], c["kv_lora_rank"], 64
    nope, v = c["qk_nope_head_dim"], c["v_head_dim"]
    attention = d * h * (nope + rope) + d * (lora + rope) + lora * h * (nope + v) + h * v * d
    per_layer = attention + 3 * d * c["intermediate_size"]
    layers = c["num_hidden_layers"]
    weights = 2 * (layers * per_layer + c["vocab_size"] * d)
    latent = batch * context * layers * (lora + rope) * 2
    return (weights + latent) / bandwidth * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--cases", nargs="+", help="CONTEXTxBATCH, e.g. 4096x64")
    parser.add_argument("--load-format", choices=["auto", "dummy"], default="dummy")
    args = parser.parse_args()
    cases = [tuple(map(int, c.split("x"))) for c in args.cases] if args.cases else CASES

    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print("| engine | context | batch | ms/step | floor ms | x floor |")
    print("| --- | --- | --- | --- | --- | --- |")

    def row(name: str, context: int, batch: int, ms: float) -> None:
        # Rows as they come: Heron's stand even if the HF baseline fails.
        floor = floor_ms(batch, context + args.new_tokens // 2, bandwidth)
        print(f"| {name} | {context} | {batch} | {ms:.3f} | {floor:.3f} | {ms / floor:.2f}x |")

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        build_model(path, args.load_format)
        longest = max(context for context, _ in cases) + args.new_tokens
        llm = LLM(str(path), max_model_len=longest, load_format=args.load_format)
        heron_decode_ms(llm, [[3] * 256] * 2, 16)  # warm-up: Triton compiles its variants
        for context, batch in cases:
            prompts = [[(7 + i + j) % 100000 + 2 for j in range(context)] for i in range(batch)]
            row("Heron", context, batch, heron_decode_ms(llm, prompts, args.new_tokens)[0])
        del llm
        torch.cuda.empty_cache()
        if args.skip_hf:
            return
        model = hf_model(path, args.load_format)
        for context, batch in cases:
            if batch == 1:
                prompt = [[(7 + j) % 100000 + 2 for j in range(context)]]
                row("HF transformers", context, 1, hf_decode_ms(model, prompt, args.new_tokens)[0])


if __name__ == "__main__":
    main()
