"""Qwen3-VL against HF transformers in fp32 on a tiny random model and synthetic images."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from mm_models import IMAGE, hf_greedy_mm, save_qwen3_5_vl, save_qwen3_vl, synthetic_image

from heron import LLM, SamplingParams

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl"))


@pytest.fixture(scope="module")
def hf(model_dir):
    model = tf.Qwen3VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(str(model_dir), dtype="float32", max_num_batched_tokens=64, block_size=16) as llm:
        yield llm


def expected(llm, hf, prompt: dict) -> list[int]:
    text, ids, items = llm._multimodal_prompt(prompt)
    images = prompt["multi_modal_data"]["image"]
    images = images if isinstance(images, list) else [images]
    return hf_greedy_mm(hf, llm._image_processor.hf, ids, images, MAX_NEW)


def test_one_image(llm, hf):
    prompt = {
        "prompt": f"The quick {IMAGE} brown fox",
        "multi_modal_data": {"image": synthetic_image(40, 56, 0)},
    }
    out = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert out.error is None
    assert out.outputs[0].token_ids == expected(llm, hf, prompt)


SMALL, LARGE = synthetic_image(40, 56, 0), synthetic_image(64, 64, 1)
LONG_TEXT = "Paris is the capital of France, and Berlin is the capital of Germany. " * 2


def test_images_change_the_answer(llm):
    prompts = [
        {"prompt": f"The quick {IMAGE} brown fox", "multi_modal_data": {"image": image}}
        for image in (SMALL, synthetic_image(40, 56, 7))
    ]
    a, b = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert a.outputs[0].token_ids != b.outputs[0].token_ids


def test_two_images_and_a_batch_beside_text_prompts(llm, hf):
    prompts = [
        {
            "prompt": f"{IMAGE} The quick {IMAGE} brown fox",
            "multi_modal_data": {"image": [SMALL, LARGE]},
        },
        "The quick brown fox jumps over",
        {"prompt": f"Numbers: {IMAGE} 0 1 2", "multi_modal_data": {"image": [LARGE]}},
        [5, 6, 7, 8],
    ]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.error is None
        if isinstance(prompt, dict):
            want = expected(llm, hf, prompt)
        else:
            ids = llm.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
            want = hf_greedy_mm(hf, None, ids, [], MAX_NEW)
        assert out.outputs[0].token_ids == want


def test_image_across_a_chunk_boundary(llm, hf):
    """The step budget (64 tokens) ends inside the image's placeholders: the encoder runs
    once, its rows are split between the two chunks."""
    prompt = {"prompt": f"{LONG_TEXT}{IMAGE} fox", "multi_modal_data": {"image": LARGE}}
    _, ids, (item,) = llm._multimodal_prompt(prompt)
    assert item.offset < 64 < item.end
    encoded = llm.engine.runner.multimodal.cache.num_encoded
    out = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected(llm, hf, prompt)
    assert llm.engine.runner.multimodal.cache.num_encoded == encoded + 1


def test_prefix_cache_same_image_hits_different_image_misses(llm, hf):
    image = synthetic_image(64, 64, 11)
    first = {"prompt": f"{LONG_TEXT}{IMAGE} fox jumps", "multi_modal_data": {"image": image}}
    llm.generate(first, GREEDY, use_tqdm=False)
    _, ids, (item,) = llm._multimodal_prompt(first)
    again = llm.generate(first, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens >= item.end // 16 * 16 > item.offset
    assert again.outputs[0].token_ids == expected(llm, hf, first)
    other = {"prompt": first["prompt"], "multi_modal_data": {"image": synthetic_image(64, 64, 12)}}
    miss = llm.generate(other, GREEDY, use_tqdm=False)[0]
    assert miss.num_cached_tokens <= item.offset  # the text before the image only
    assert miss.outputs[0].token_ids == expected(llm, hf, other)


def test_encoder_cache_empty_after_finish_and_abort(llm):
    cache = llm.engine.runner.multimodal.cache

    def prompt(seed: int) -> dict:
        image = synthetic_image(64, 64, seed)
        text = f"{chr(65 + seed % 26)}{LONG_TEXT}{IMAGE} fox"  # (no prefix hit)
        return {"prompt": text, "multi_modal_data": {"image": image}}

    encoded = cache.num_encoded
    llm.generate([prompt(21), prompt(21)], GREEDY, use_tqdm=False)
    assert len(cache) == 0 and cache.num_holders == 0
    assert cache.num_encoded == encoded + 1  # one image in two prompts: encoded once
    _, _, (item,) = llm._multimodal_prompt(prompt(22))
    assert item.offset < 64 < item.end
    llm.add_request("aborted", prompt(22), GREEDY)
    llm.step()  # the first chunk ends inside the image: its output is held
    assert len(cache) == 1 and cache.num_holders == 1
    llm.abort_request("aborted")
    llm.step()
    assert len(cache) == 0 and cache.num_holders == 0
    assert cache.num_encoded == encoded + 2


def test_chat_with_image_parts(llm, hf):
    import base64
    import io

    buffer = io.BytesIO()
    SMALL.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    content = [
        {"type": "text", "text": "The quick"},
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "image_pil", "image_pil": LARGE},
    ]
    out = llm.chat([{"role": "user", "content": content}], GREEDY, use_tqdm=False)[0]
    text = f"<|user|>The quick{IMAGE}{IMAGE}<|end|><|assistant|>"
    prompt = {"prompt": text, "multi_modal_data": {"image": [SMALL, LARGE]}}
    assert out.outputs[0].token_ids == expected(llm, hf, prompt)


def test_bad_inputs_are_refused(llm):
    too_big = synthetic_image(80, 80, 0)
    cases = {
        "2 image placeholders but 1 images": {
            "prompt": f"{IMAGE}{IMAGE}",
            "multi_modal_data": {"image": SMALL},
        },
        "more than the image processor's maximum": {
            "prompt": IMAGE,
            "multi_modal_data": {"image": too_big},
        },
        "video not supported": {"prompt": "x", "multi_modal_data": {"video": [SMALL]}},
    }
    for message, prompt in cases.items():
        (out,) = llm.generate(prompt, GREEDY, use_tqdm=False)
        assert message in out.error


def test_images_refused_beside_speculative_decoding(model_dir):
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    with LLM(str(model_dir), dtype="float32", speculative_config=spec) as spec_llm:
        prompt = {"prompt": IMAGE, "multi_modal_data": {"image": SMALL}}
        (out,) = spec_llm.generate(prompt, GREEDY, use_tqdm=False)
        assert "images are not supported with speculative_config yet" in out.error
        (text,) = spec_llm.generate("The quick brown fox", GREEDY, use_tqdm=False)
        assert text.error is None and len(text.outputs[0].token_ids) == MAX_NEW


def test_text_only_model_refuses_images(tmp_path):
    from tiny_models import save_tiny_model

    path = save_tiny_model("qwen3", tmp_path)
    with LLM(str(path), dtype="float32", limit_mm_per_prompt={"image": 1}) as text_llm:
        prompt = {"prompt": "x", "multi_modal_data": {"image": SMALL}}
        (out,) = text_llm.generate(prompt, GREEDY, use_tqdm=False)
        assert "text-only model" in out.error


def test_preemption_recomputes_images_and_leaks_nothing(model_dir, hf):
    """A pool too small for three image prompts at once: requests are preempted mid-way,
    give their images back, and recompute them when they run again."""
    prompts = [
        {
            "prompt": f"{chr(70 + seed)}{LONG_TEXT}{IMAGE} fox jumps over",
            "multi_modal_data": {"image": synthetic_image(64, 64, 30 + seed)},
        }
        for seed in range(3)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    options = dict(
        dtype="float32",
        max_num_batched_tokens=64,
        block_size=16,
        num_kv_blocks=14,
        max_model_len=192,
    )
    with LLM(str(model_dir), **options) as small:
        outs = small.generate(prompts, params, use_tqdm=False)
        assert small.engine.scheduler.num_preemptions > 0
        cache = small.engine.runner.multimodal.cache
        assert len(cache) == 0 and cache.num_holders == 0
        for prompt, out in zip(prompts, outs):
            _, ids, _ = small._multimodal_prompt(prompt)
            image = [prompt["multi_modal_data"]["image"]]
            want = hf_greedy_mm(hf, small._image_processor.hf, ids, image, 16)
            assert out.outputs[0].token_ids == want


def test_qwen3_5_with_images(tmp_path):
    """Qwen3.5's vision tower and partial M-RoPE over gated-delta-rule layers: two images in
    a prompt, an image across a chunk boundary, a text prompt beside them."""
    path = save_qwen3_5_vl(tmp_path)
    hf = tf.Qwen3_5ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [
        {"prompt": f"{IMAGE} The quick {IMAGE} fox", "multi_modal_data": {"image": [SMALL, LARGE]}},
        {"prompt": f"A{LONG_TEXT}{IMAGE} fox", "multi_modal_data": {"image": LARGE}},
        "The quick brown fox jumps over",
    ]
    with LLM(str(path), dtype="float32", max_num_batched_tokens=64, block_size=16) as vl:
        outs = vl.generate(prompts, GREEDY, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            if isinstance(prompt, dict):
                want = expected(vl, hf, prompt)
            else:
                want = hf_greedy_mm(hf, None, vl.tokenizer.encode(prompt), [], MAX_NEW)
            assert out.outputs[0].token_ids == want
