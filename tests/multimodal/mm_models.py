"""A tiny random Qwen3-VL checkpoint (tokenizer with the vision tokens, the PIL image
processor's config, a chat template rendering image parts) and HF's greedy reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers as tf
from models.test_qwen3_5 import randomize as randomize_qwen3_5
from PIL import Image

from tiny_models import BASE, CORPUS, QWEN3_5, make_tokenizer

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


GEMMA3_TOKENS = {
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
}
# Gemma 3's chat template renders an image part as its begin-of-image token.
GEMMA3_IMAGE = GEMMA3_TOKENS["boi_token"]
GEMMA3_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(IMAGE, GEMMA3_IMAGE)


def gemma3_tokenizer():
    """A BPE tokenizer shaped as Gemma's (spaces become ``▁``, a run of up to four newlines is
    one token whatever follows it), with Gemma 3's image tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("\n+"), "isolated")
    tok.decoder = decoders.Replace("\u2581", " ")
    alphabet = [chr(c) for c in range(33, 127)] + ["\n", "\u2581"]
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|end|>", "<unk>"],
        initial_alphabet=alphabet,
    )
    newlines = [f"a{chr(10) * n}b" for n in (1, 2, 3, 4)]
    tok.train_from_iterator((CORPUS + newlines * 8) * 4, trainer)
    fast = tf.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", unk_token="<unk>"
    )
    fast.add_special_tokens({"additional_special_tokens": list(GEMMA3_TOKENS.values())})
    fast.chat_template = GEMMA3_CHAT_TEMPLATE
    return fast


def save_gemma3(path: Path, seed: int = 0) -> Path:
    """Gemma 3 with its SigLIP tower: a sliding-window layer (window 8, shorter than the
    prompts) and a full one; 32x32 images of 4x4 patches pooled to 4 image tokens."""
    torch.manual_seed(seed)
    tokenizer = gemma3_tokenizer()
    boi, eoi, image = tokenizer.convert_tokens_to_ids(list(GEMMA3_TOKENS.values()))
    text = BASE | dict(
        vocab_size=len(tokenizer),
        num_hidden_layers=2,
        head_dim=16,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
        tie_word_embeddings=False,
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
    )
    config = tf.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        boi_token_index=boi,
        eoi_token_index=eoi,
        image_token_index=image,
        tie_word_embeddings=False,
    )
    model = tf.Gemma3ForConditionalGeneration(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # the projection included: HF initialises it to zeros
                p.normal_(0.0, 0.08)
            elif "norm" in name:
                p.uniform_(-0.2, 0.2)  # (Gemma's norms scale by 1 + w)
            else:
                p.normal_(0.0, 0.02)
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    tf.Gemma3ImageProcessorPil(size={"height": 32, "width": 32}).save_pretrained(path)
    return path


def gemma3_hf_processor(path: Path):
    """HF's own Gemma 3 processor over the saved tokenizer and image processor."""
    tokenizer = tf.AutoTokenizer.from_pretrained(path, extra_special_tokens=GEMMA3_TOKENS)
    image_processor = tf.Gemma3ImageProcessorPil.from_pretrained(path)
    return tf.Gemma3Processor(
        image_processor=image_processor, tokenizer=tokenizer, image_seq_length=4
    )
