"""Qwen3-VL against HF transformers in fp32 on a tiny random model and synthetic images."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from mm_models import IMAGE, hf_greedy_mm, save_qwen3_vl, synthetic_image

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
