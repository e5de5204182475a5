"""Tiny random-weight HF models built from configs (no network), and test helpers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "Heron batches requests continuously over a paged key-value cache.",
    "def add(a, b):\n    return a + b\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000; symbols: !?.,;:-_()[]{}",
]


def make_tokenizer(vocab_size: int = 320):
    """A byte-level BPE tokenizer trained on a few sentences, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


BASE = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    eos_token_id=0,
    bos_token_id=0,
    pad_token_id=0,
)

# Shapes the tensor-parallel tests shard ("a rank": of two) and the dummy-weight tests fill.
# DeepSeek: 4 heads (2 a rank), a dense first layer, then routed and shared experts.
DEEPSEEK = BASE | dict(
    num_hidden_layers=2,
    num_key_value_heads=4,  # HF's MLA: one per query head
    first_k_dense_replace=1,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_group=2,
    topk_group=1,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=12,
    tie_word_embeddings=False,
)
# GDN layers of 2 key heads (one a rank) with 2 value heads each, around gated attention.
QWEN3_5 = BASE | dict(
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
)


def tiny_config(family: str):
    """A small random config of each supported family, exercising its special features."""
    import transformers as tf

    if family == "llama":  # untied, llama3 rope scaling
        return tf.LlamaConfig(
            **BASE,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        )
    if family == "qwen2":  # qkv bias, tied
        return tf.Qwen2Config(**BASE, tie_word_embeddings=True, rope_theta=1e6)
    if family == "qwen3":  # qk-norm, explicit head_dim different from hidden/heads
        return tf.Qwen3Config(**BASE, head_dim=32, tie_word_embeddings=True)
    if family == "mistral":  # sliding window over every layer
        return tf.MistralConfig(**BASE, sliding_window=24, tie_word_embeddings=False)
    raise ValueError(family)


FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]


def save_tiny_model(
    family: str, path: Path, seed: int = 0, added_tokens: tuple[str, ...] = ()
) -> Path:
    return save_random_model(tiny_config(family), path, seed, added_tokens)


def save_random_model(
    config,
    path: Path,
    seed: int = 0,
    added_tokens: tuple[str, ...] = (),
    auto_class: str = "AutoModelForCausalLM",
) -> Path:
    """An HF model of ``config`` with random weights, and the test tokenizer, saved to ``path``.

    ``added_tokens``: tokens the tokenizer gets beyond its trained vocabulary (as a reasoning
    model's ``<think>``), each one id, which the model's vocabulary grows to hold;
    ``auto_class``: the transformers class that builds it (a sequence classifier's)."""
    import transformers as tf

    torch.manual_seed(seed)
    tokenizer = make_tokenizer()
    if added_tokens:
        tokenizer.add_tokens(list(added_tokens))
        config.vocab_size = len(tokenizer)
    model = getattr(tf, auto_class).from_config(config, dtype=torch.float32)
    # Random init is small; scale weights up so logits are not near-uniform (no near-ties).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # matrices, and stacked experts
                p.normal_(0.0, 0.08)
            elif "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.02)
    if model.can_generate():
        model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# Pooling models: two layers of the Qwen3 shape.
POOLING = BASE | dict(num_hidden_layers=2, head_dim=32, tie_word_embeddings=True)


def save_embedding_model(path: Path, pooling_mode: str, normalize: bool, seed: int = 0):
    """A tiny Qwen3 decoder saved as sentence-transformers saves an embedding model
    (Transformer, Pooling of ``pooling_mode``, Normalize if asked), and that pipeline (the
    reference). The tokenizer has no chat template, which sentence-transformers would apply."""
    import transformers as tf
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    decoder = save_random_model(tf.Qwen3Config(**POOLING), path / "decoder", seed)
    tokenizer = tf.AutoTokenizer.from_pretrained(decoder)
    tokenizer.pad_token, tokenizer.chat_template = tokenizer.eos_token, None
    (decoder / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer.save_pretrained(decoder)
    modules = [
        Transformer(str(decoder)),
        Pooling(POOLING["hidden_size"], pooling_mode=pooling_mode),
    ]
    pipeline = SentenceTransformer(modules=modules + [Normalize()] * normalize)
    pipeline.save(str(path / "st"))
    return path / "st", pipeline


def save_classifier(path: Path, num_labels: int, seed: int = 0, family: str = "qwen3") -> Path:
    """A tiny Qwen3ForSequenceClassification (a reranker with one label), or Llama's."""
    import transformers as tf

    config_class = {"qwen3": tf.Qwen3Config, "llama": tf.LlamaConfig}[family]
    config = config_class(**POOLING, num_labels=num_labels)
    return save_random_model(config, path, seed, auto_class="AutoModelForSequenceClassification")


def save_truncated_draft(target: Path, path: Path) -> Path:
    """A draft model for ``target``: its weights without the last decoder layer (a smaller
    model with the same tokenizer, whose greedy tokens often but not always agree)."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    model.model.layers = model.model.layers[:-1]
    model.config.num_hidden_layers -= 1
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:-1]
    model.save_pretrained(path)
    tf.AutoTokenizer.from_pretrained(target).save_pretrained(path)
    return path


def attend(op, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Run an attention operator on separate q [T,H,D], k, v [T,KVH,D] (it takes them packed)."""
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    return op(qkv).view_as(q)


def hf_greedy(hf, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """HF transformers' greedy continuation of each prompt (no EOS stop: ids only)."""
    return [
        hf.generate(
            torch.tensor([p], device=hf.device),
            max_new_tokens=max_new,
            do_sample=False,
            pad_token_id=0,
        )[0, len(p) :].tolist()
        for p in prompts
    ]


def greedy_tokens(llm, prompts: list[list[int]], params) -> list[list[int]]:
    """Heron's token ids for each prompt under ``params``."""
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def check_greedy_and_logprobs(llm, hf, prompts: list[list[int]], params) -> None:
    """Heron's greedy tokens for ``prompts`` are HF's, and its prompt logprobs of the first
    prompt HF's to 1e-4 (the weights' formats dequantise to the same fp32 figures)."""
    from heron import SamplingParams

    assert greedy_tokens(llm, prompts, params) == hf_greedy(hf, prompts, params.max_tokens)
    out = llm.generate(prompts[0], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    got = torch.tensor([lp.logprob for lp in out[0].prompt_logprobs[1:]])
    torch.testing.assert_close(got, hf_prompt_logprobs(hf, prompts[0]), atol=1e-4, rtol=1e-4)


def hf_prompt_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    """HF transformers' log-probability of each prompt token after the ones before it."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, -1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]


# Prompts for engine parity tests with 16-token blocks: the first two share a 32-token prefix
# (two full blocks), one is shorter than a block, one spans several.
SHARED_PREFIX_PROMPTS = [
    list(range(10, 42)) + [7, 8, 9],
    list(range(10, 42)) + [200, 201, 202, 203, 204],
    [3, 4, 5, 6],
    [(i * 37) % 300 + 5 for i in range(50)],
]


def rerun_from_prefix_cache(llm, prompts: list[list[int]], params, refs) -> None:
    """Run ``prompts`` again on ``llm``, which ran them before: equal tokens, the shared prefix
    of the first (two blocks) taken from the cache."""
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == refs
    assert outputs[0].num_cached_tokens == 32
    assert llm.engine.kv_cache.prefix_cache_hits > 0


def prompt_logprob_error(llm, hf, prompt: list[int]) -> float:
    """The largest difference between Heron's and HF's prompt logprobs of ``prompt``."""
    from heron import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    got = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])
    return (got - hf_prompt_logprobs(hf, prompt)).abs().max().item()


def cuda_graph_llm(path: Path, **options):
    """An fp32 engine on CUDA with decode graphs up to batch 4 and 32-token prefill chunks, for
    exact greedy parity with HF on the GPU; ``options`` are more engine options."""
    from heron import LLM

    llm = LLM(
        str(path),
        device="cuda",
        dtype="float32",
        max_model_len=128,
        num_kv_blocks=64,
        cuda_graph_max_bs=4,
        max_num_batched_tokens=32,
        **options,
    )
    assert llm.engine.runner.graphs is not None
    return llm


def save_with_hf_reference(model, path, prompts: list[list[int]], max_new: int):
    """Save ``model`` (with the test tokenizer) to ``path``, load it back as HF's eager fp32
    reference; return ``(path, hf, HF's greedy continuations of prompts)``."""
    import transformers as tf

    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    hf = tf.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return path, hf, hf_greedy(hf, prompts, max_new)


def first_divergence_is_a_near_tie(hf, prompt: list[int], got: list[int], want: list[int]) -> bool:
    """DESIGN §5: where greedy outputs diverge, each side's token is in the other's top-5."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + want[:i]], device=hf.device)).logits[0, -1]
            return a in logits.topk(5).indices.tolist()
    return True


FP8_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _per_tensor_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale for the whole matrix, as per-tensor FP8 checkpoints store it."""
    from heron.layers.fp8 import FP8, FP8_MAX

    scale = w.abs().max().float() / FP8_MAX
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def write_fp8_checkpoint(
    src: Path,
    dst: Path,
    layout: str,
    skip: tuple[str, ...] = (),
    block: tuple[int, int] = (32, 32),
    projections: tuple[str, ...] = FP8_PROJECTIONS,
) -> dict[str, torch.Tensor]:
    """``src`` re-saved with FP8 ``projections`` (each expert's too, where the checkpoint holds
    one tensor per expert; but those in ``skip``, which the config lists as
    ``modules_to_not_convert``), ``layout`` per tensor, per channel or in ``block`` tiles;
    returns the dequantised weights HF should run, by checkpoint name."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from heron.layers.fp8 import dequantize, quantize

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    dequantised = {}
    projections = [p for p in projections if p not in skip]
    for name in [n for n in tensors if n.endswith("weight") and n.split(".")[-2] in projections]:
        w = tensors.pop(name)
        if layout == "per-tensor":
            q, scale = _per_tensor_fp8(w)
            tensors[name + "_scale"] = scale
            tensors[name.removesuffix("weight") + "input_scale"] = torch.tensor(0.05)
            dequantised[name] = q.float() * scale
        elif layout == "per-channel":  # [N, 1], as compressed-tensors stores them
            q, scale = quantize(w)
            tensors[name + "_scale"] = scale[:, None]
            dequantised[name] = dequantize(q, scale)
        else:
            q, scale = quantize(w, block)
            tensors[name + "_scale_inv"] = scale
            dequantised[name] = dequantize(q, scale, block)
        tensors[name] = q
    save_file(tensors, dst / "model.safetensors")
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {
        "per-tensor": {"quant_method": "fp8", "activation_scheme": "static"},
        "per-channel": {"quant_method": "fp8", "activation_scheme": "dynamic"},
        "block-wise": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block)},
    }[layout]
    if skip:
        config["quantization_config"]["modules_to_not_convert"] = list(skip)
    (dst / "config.json").write_text(json.dumps(config))
    return dequantised


def hf_on_saved_weights(src: Path, weights: dict[str, torch.Tensor], dst: Path):
    """HF's model of ``src`` with checkpoint tensors ``weights`` (by checkpoint name, as
    :func:`write_fp8_checkpoint` returns them) in place of its own: a copy at ``dst`` that HF
    loads, mapping per-expert tensors onto its stacked experts itself."""
    import shutil

    import transformers as tf
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors") | weights
    save_file({name: t.contiguous() for name, t in tensors.items()}, dst / "model.safetensors")
    return tf.AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()


def hf_on_weights(src: Path, weights: dict[str, torch.Tensor]):
    """HF's model of ``src`` with ``weights`` in place of its own."""
    import transformers as tf

    hf = tf.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    state = hf.state_dict()
    state.update(weights)
    hf.load_state_dict(state)
    return hf


def save_random_adapter(
    base: Path, path: Path, seed: int, r: int, targets: list[str], **options
) -> Path:
    """A PEFT LoRA adapter of ``base`` with random A and B (B non-zero, so it changes the
    outputs), saved to ``path``; ``options`` are ``peft.LoraConfig``'s (``lora_alpha``,
    ``use_rslora``, ``target_parameters`` for stacked experts, ...)."""
    import peft
    import transformers as tf

    hf = tf.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(r=r, target_modules=targets, init_lora_weights=False, **options)
    torch.manual_seed(seed)
    model = peft.get_peft_model(hf, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.1)
    model.save_pretrained(path)
    return path


def edited_adapter_copy(src: str, dst: Path, config: dict, edit) -> str:
    """A copy of adapter ``src`` with ``config`` merged into its config and ``edit`` applied
    to its tensors (a dict, edited in place)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    path = dst / "adapter_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | config))
    tensors = load_file(dst / "adapter_model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "adapter_model.safetensors")
    return str(dst)


def peft_greedy(base: Path, adapter: Path, prompts: list[list[int]], max_new: int):
    """HF + PEFT's greedy continuations of ``prompts`` under ``adapter`` (fp32)."""
    import peft
    import transformers as tf

    hf = tf.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return hf_greedy(peft.PeftModel.from_pretrained(hf, adapter).eval(), prompts, max_new)


def lora_tokens(llm, prompts: list[list[int]], params, loras: list) -> list[list[int]]:
    """The LLM's tokens for each prompt under its adapter (``loras``: requests or None)."""
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    return [o.outputs[0].token_ids for o in outputs]
