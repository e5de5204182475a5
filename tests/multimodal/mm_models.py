"""A tiny random Qwen3-VL checkpoint (tokenizer with the vision tokens, the PIL image
processor's config, a chat template rendering image parts) and HF's greedy reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers as tf
from models.test_qwen3_5 import randomize as randomize_qwen3_5
from PIL import Image

from tiny_models import BASE, QWEN3_5, make_tokenizer

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{% if m['content'] is string %}"
    "{{ m['content'] }}{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}"
    + IMAGE
    + "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def vision_tokenizer():
    tokenizer = make_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


VISION = dict(
    depth=3,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=64,
    patch_size=8,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=16,
)


TEXT = BASE | dict(tie_word_embeddings=False)  # (vocab_size: the tokenizer's, set by each)


def mrope(section: list[int], **extra) -> dict:
    """Interleaved M-RoPE parameters of ``section`` (``extra``: partial rotary, say)."""
    return {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section} | extra


def save_qwen3_vl(path: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    tokenizer = vision_tokenizer()
    text = TEXT | dict(vocab_size=len(tokenizer) + 1, head_dim=16, rope_parameters=mrope([4, 2, 2]))
    vision = VISION | dict(deepstack_visual_indexes=[0, 1])
    config = tf.Qwen3VLConfig(**vision_language(tokenizer, text, vision))
    model = tf.Qwen3VLForConditionalGeneration(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
            elif "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.02)
    return save(model, tokenizer, path)


def save_qwen3_5_vl(path: Path, seed: int = 0) -> Path:
    """Qwen3.5 with its vision tower: gated-delta-rule layers around gated attention, partial
    M-RoPE (a quarter of each head's 32 dims)."""
    torch.manual_seed(seed)
    tokenizer = vision_tokenizer()
    text = QWEN3_5 | dict(
        vocab_size=len(tokenizer) + 1,
        head_dim=32,
        tie_word_embeddings=False,
        rope_parameters=mrope([2, 1, 1], partial_rotary_factor=0.25),
    )
    config = tf.Qwen3_5Config(**vision_language(tokenizer, text, VISION))
    model = tf.Qwen3_5ForConditionalGeneration(config).float()
    randomize_qwen3_5(model)
    return save(model, tokenizer, path)


def vision_language(tokenizer, text: dict, vision: dict) -> dict:
    """A multimodal config's fields: its text and vision parts, the vision token ids."""
    start, end, pad = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    return dict(
        text_config=text,
        vision_config=vision,
        vision_start_token_id=start,
        vision_end_token_id=end,
        image_token_id=pad,
        video_token_id=len(tokenizer),
        tie_word_embeddings=False,
    )


def save(model, tokenizer, path: Path) -> Path:
    """The model, its tokenizer and a PIL image processor of its patch size."""
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    processor = tf.Qwen2VLImageProcessorPil(
        patch_size=8, merge_size=2, temporal_patch_size=2, min_pixels=256, max_pixels=64 * 64
    )
    processor.save_pretrained(path)
    return path


def synthetic_image(width: int, height: int, seed: int) -> Image.Image:
    pixels = np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def hf_greedy_mm(hf, processor, prompt_ids: list[int], images, max_new: int) -> list[int]:
    """HF's greedy continuation of a prompt whose image placeholders are expanded already."""
    ids = torch.tensor([prompt_ids])
    kwargs = {}
    if images:
        out = processor(images=[i.convert("RGB") for i in images], return_tensors="pt")
        kwargs = dict(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"])
        kwargs["mm_token_type_ids"] = (ids == hf.config.image_token_id).int()
    generated = hf.generate(ids, max_new_tokens=max_new, do_sample=False, pad_token_id=0, **kwargs)
    return generated[0, len(prompt_ids) :].tolist()
