"""The model shapes the benchmarks run, as random-weight checkpoints: ``config.json`` and a
word-level tokenizer, no weights (``load_format="dummy"`` makes them on the device)."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

QWEN3_0_6B = dict(
    hidden_size=1024,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=3072,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
)
QWEN3_8B = QWEN3_0_6B | dict(
    hidden_size=4096,
    num_hidden_layers=36,
    num_attention_heads=32,
    intermediate_size=12288,
    tie_word_embeddings=False,
)
GEMMA3_1B = dict(  # five 512-token sliding-window layers, then one full layer, repeating
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
QWEN3_5_0_8B = dict(  # three gated-delta-rule layers, then one gated full-attention layer
    hidden_size=1024,
    num_hidden_layers=24,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    intermediate_size=3584,
    vocab_size=248320,
    tie_word_embeddings=True,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
)
QWEN3_5_35B_A3B = dict(
    QWEN3_5_0_8B,
    hidden_size=2048,
    num_hidden_layers=40,
    num_attention_heads=16,
    linear_num_value_heads=32,
    num_experts=256,
    num_experts_per_tok=8,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    tie_word_embeddings=False,
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
# gpt-oss-20b: sliding (128) and full layers in turn, 32 experts of 2880 (top 4), attention sinks.
GPT_OSS_20B = dict(
    hidden_size=2880,
    num_hidden_layers=24,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    intermediate_size=2880,
    num_local_experts=32,
    num_experts_per_tok=4,
    sliding_window=128,
    vocab_size=201088,
    tie_word_embeddings=False,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
)
_DEEPSEEK = dict(
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    first_k_dense_replace=1,
    max_position_embeddings=16384,
    tie_word_embeddings=False,
)
DEEPSEEK_V2_LITE = dict(
    _DEEPSEEK,
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
)
DEEPSEEK_V3_5L = dict(  # DeepSeek-V3's layers, five of them (one dense, four MoE)
    _DEEPSEEK,
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
)


# Qwen3.5-0.8B's vision tower (16-pixel patches merged 2x2 into the language model's width).
QWEN3_5_VISION = dict(
    depth=12,
    hidden_size=768,
    intermediate_size=3072,
    num_heads=12,
    out_hidden_size=1024,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=2304,
)
# The multimodal class of each text shape's family.
VISION_CLASSES = {"Qwen3_5TextConfig": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration")}


@dataclass(frozen=True)
class Shape:
    """A model shape: its transformers config class, architecture, fields, and the family
    whose bandwidth floor applies (``heron.bench.measure.step_bytes``)."""

    config_class: str
    architecture: str
    family: str  # dense, moe, hybrid (GDN + attention), mla, gpt-oss
    fields: dict[str, Any] = field(hash=False)

    def with_fields(self, **changes: Any) -> Shape:
        return Shape(self.config_class, self.architecture, self.family, self.fields | changes)


SHAPES = {
    "qwen3-0.6b": Shape("Qwen3Config", "Qwen3ForCausalLM", "dense", QWEN3_0_6B),
    "qwen3-8b": Shape("Qwen3Config", "Qwen3ForCausalLM", "dense", QWEN3_8B),
    "gemma-3-1b": Shape("Gemma3TextConfig", "Gemma3ForCausalLM", "dense", GEMMA3_1B),
    "qwen3-30b-a3b": Shape("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "moe", QWEN3_30B_A3B),
    "qwen3.5-0.8b": Shape("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", "hybrid", QWEN3_5_0_8B),
    "qwen3.5-35b-a3b": Shape(
        "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", "hybrid", QWEN3_5_35B_A3B
    ),
    "gpt-oss-20b": Shape("GptOssConfig", "GptOssForCausalLM", "gpt-oss", GPT_OSS_20B),
    "deepseek-v2-lite": Shape("DeepseekV2Config", "DeepseekV2ForCausalLM", "mla", DEEPSEEK_V2_LITE),
    "deepseek-v3-5l": Shape("DeepseekV3Config", "DeepseekV3ForCausalLM", "mla", DEEPSEEK_V3_5L),
}
# The field that gives a shape an MTP head of one layer (speculative method "mtp").
MTP_FIELD = {"Qwen3_5TextConfig": "mtp_num_hidden_layers", "DeepseekV3Config": "num_mtp_layers"}


# A checkpoint's quantization_config per ``--weight-format``: int4 weights in groups of 128 as
# the usual AWQ, GPTQ and llm-compressor W4A16 releases store them (dummy weights quantised);
# MXFP4 experts as gpt-oss is published (dummy packed values).
WEIGHT_FORMATS = {
    "mxfp4": {"quant_method": "mxfp4"},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False},
    "compressed-tensors": {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 4, "type": "int", "symmetric": True},
            }
        },
    },
}
WEIGHT_FORMATS["compressed-tensors"]["config_groups"]["group_0"]["weights"] |= {
    "strategy": "group",
    "group_size": 128,
}


def shape(
    name: str,
    num_layers: int | None = None,
    mtp: bool = False,
    weight_format: str | None = None,
) -> Shape:
    """The shape called ``name``, with ``num_layers`` decoder layers if given (a short model
    for the CPU), one MTP layer with ``mtp``, and its weights in ``weight_format`` (a key of
    ``WEIGHT_FORMATS``) if given."""
    if name not in SHAPES:
        raise ValueError(f"shape must be one of {', '.join(SHAPES)}, got {name!r}")
    out = SHAPES[name]
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be at least 1, got {num_layers}")
        out = out.with_fields(num_hidden_layers=num_layers)
    if mtp:
        if out.config_class not in MTP_FIELD:
            raise ValueError(
                f"shape {name!r} has no MTP head; those with one: "
                + ", ".join(n for n, s in SHAPES.items() if s.config_class in MTP_FIELD)
            )
        out = out.with_fields(**{MTP_FIELD[out.config_class]: 1})
    if weight_format is not None:
        if weight_format not in WEIGHT_FORMATS:
            raise ValueError(
                f"weight_format must be one of {', '.join(WEIGHT_FORMATS)}, got {weight_format!r}"
            )
        out = out.with_fields(quantization_config=WEIGHT_FORMATS[weight_format])
    return out


def with_vision(text: Shape) -> Shape:
    """The multimodal checkpoint of a text shape: its language model (interleaved M-RoPE, as
    released) and its family's vision tower; the last three token ids are the vision tokens."""
    if text.config_class not in VISION_CLASSES:
        raise ValueError(f"{text.architecture} has no vision tower here")
    config_class, architecture = VISION_CLASSES[text.config_class]
    vocab = text.fields["vocab_size"]
    rope = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25}
    fields = dict(
        text_config=text.fields | {"rope_parameters": rope | {"mrope_section": [11, 11, 10]}},
        vision_config=QWEN3_5_VISION,
        vision_start_token_id=vocab - 3,
        vision_end_token_id=vocab - 2,
        image_token_id=vocab - 1,
        tie_word_embeddings=text.fields["tie_word_embeddings"],
    )
    return Shape(config_class, architecture, text.family, fields)


def write_checkpoint(shape: Shape, path: Path) -> None:
    """``config.json`` and a word-level tokenizer (token ``t<i>`` is id ``i``; EOS ``t1``,
    which the benchmarks ignore): what ``load_format="dummy"`` needs; a multimodal shape's
    image processor too (its PIL class's config)."""
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = getattr(tf, shape.config_class)(**shape.fields)
    config.architectures = [shape.architecture]
    config.save_pretrained(path)
    vision = shape.fields.get("vision_config")
    if vision is not None:
        tf.Qwen2VLImageProcessorPil(
            patch_size=vision["patch_size"],
            merge_size=vision["spatial_merge_size"],
            temporal_patch_size=vision["temporal_patch_size"],
        ).save_pretrained(path)
    text = shape.fields.get("text_config", shape.fields)
    vocab = {f"t{i}": i for i in range(text["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tf.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="t1").save_pretrained(path)


@contextlib.contextmanager
def dummy_checkpoint(shape: Shape) -> Iterator[str]:
    """A temporary directory holding ``shape``'s checkpoint (:func:`write_checkpoint`)."""
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(shape, Path(tmp))
        yield tmp
