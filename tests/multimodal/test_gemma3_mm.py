"""Gemma 3 with images against HF transformers in fp32 on a tiny random model: the SigLIP
tower and projector, image features in place of the placeholders, and image tokens that attend
to their whole image (a sliding-window layer among the layers)."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from mm_models import (
    GEMMA3_IMAGE,
    gemma3_hf_processor,
    gemma3_tokenizer,
    save_gemma3,
    synthetic_image,
)

from heron import LLM, SamplingParams

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
IMAGE = GEMMA3_IMAGE
GEMMA3_IMAGE_ID = gemma3_tokenizer().convert_tokens_to_ids(GEMMA3_IMAGE)
SMALL, LARGE = synthetic_image(40, 56, 0), synthetic_image(64, 64, 1)


def long_prompt(image, tail: list[int]) -> dict:
    """28 text tokens, then the image: its tokens are 30 .. 33 (after ``\\n\\n`` and the
    begin-of-image token), across the 32-token step budget and the second 16-token block."""
    boi = GEMMA3_IMAGE_ID
    return {"prompt_token_ids": [*range(10, 38), boi, *tail], "multi_modal_data": {"image": image}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_gemma3(tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="module")
def hf(model_dir):
    model = tf.Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(str(model_dir), dtype="float32", max_num_batched_tokens=32, block_size=16) as llm:
        yield llm


def hf_greedy(hf, llm, prompt, bidirectional: bool = True, max_new: int = MAX_NEW) -> list[int]:
    """HF's greedy continuation of the prompt as Heron expands it (with token_type_ids: image
    tokens attend to their whole image; without: causally)."""
    if isinstance(prompt, dict):
        _, ids, _ = llm._multimodal_prompt(prompt)
        images = prompt["multi_modal_data"]["image"]
        images = images if isinstance(images, list) else [images]
    else:
        ids, images = (llm.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt), []
    ids = torch.tensor([ids])
    kwargs = {}
    if images:
        processor = llm._image_processor.hf
        pixels = processor(images=[i.convert("RGB") for i in images], return_tensors="pt")
        kwargs["pixel_values"] = pixels["pixel_values"]
        if bidirectional:
            kwargs["token_type_ids"] = (ids == hf.config.image_token_index).long()
    out = hf.generate(ids, max_new_tokens=max_new, do_sample=False, pad_token_id=0, **kwargs)
    return out[0, ids.shape[1] :].tolist()


def test_placeholders_expand_as_hf_s_processor(llm, model_dir):
    """The image sequence (newlines, begin/end of image, image tokens) HF's Gemma3Processor
    writes, the newline before an image merged into one token with the sequence's."""
    text = f"<|user|>The quick\n{IMAGE}\nbrown{IMAGE} fox<|end|>"
    prompt = {"prompt": text, "multi_modal_data": {"image": [SMALL, LARGE]}}
    _, ids, items = llm._multimodal_prompt(prompt)
    want = gemma3_hf_processor(model_dir)(text=text, images=[SMALL, LARGE], return_tensors="pt")
    assert ids == want["input_ids"][0].tolist()
    is_image = want["token_type_ids"][0].tolist()
    assert [i for i, t in enumerate(is_image) if t] == [
        i for item in items for i in range(item.offset, item.end)
    ]
    torch.testing.assert_close(torch.cat([i.pixel_values for i in items]), want["pixel_values"])


def test_one_image(llm, hf):
    prompt = {"prompt": f"The quick {IMAGE} brown fox", "multi_modal_data": {"image": SMALL}}
    out = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert out.error is None
    assert out.outputs[0].token_ids == hf_greedy(hf, llm, prompt)


def test_prompt_logprobs_see_the_whole_image(llm, hf):
    """Every prompt position's log-probability is HF's with image tokens attending to their
    whole image, and measurably not HF's with them causal."""
    prompt = {"prompt": f"The quick {IMAGE} brown fox", "multi_modal_data": {"image": SMALL}}
    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    _, ids, _ = llm._multimodal_prompt(prompt)
    got = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])
    pixels = llm._image_processor.hf(images=[SMALL], return_tensors="pt")["pixel_values"]
    ids = torch.tensor([ids])

    def hf_logprobs(**kwargs) -> torch.Tensor:
        with torch.no_grad():
            logits = hf(input_ids=ids, pixel_values=pixels, **kwargs).logits[0]
        picked = torch.log_softmax(logits, -1)[torch.arange(ids.shape[1] - 1), ids[0, 1:]]
        return picked

    whole = hf_logprobs(token_type_ids=(ids == hf.config.image_token_index).long())
    assert (got - whole).abs().max().item() <= 1e-3
    assert (got - hf_logprobs()).abs().max().item() > 0.05


def test_two_images_and_a_batch_beside_text_prompts(llm, hf):
    prompts = [
        {
            "prompt": f"{IMAGE} The quick {IMAGE} brown fox",
            "multi_modal_data": {"image": [SMALL, LARGE]},
        },
        "The quick brown fox jumps over",
        {"prompt": f"Numbers:\n{IMAGE} 0 1 2", "multi_modal_data": {"image": [LARGE]}},
        [5, 6, 7, 8],
    ]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.error is None
        assert out.outputs[0].token_ids == hf_greedy(hf, llm, prompt)
    cache = llm.engine.runner.multimodal.cache
    assert len(cache) == 0 and cache.num_holders == 0  # (each image's output freed)


def test_a_chunk_never_ends_inside_an_image(llm, hf):
    """The step budget (32 tokens) would end inside the image's tokens: the first chunk stops
    before the image, the next holds all of it."""
    prompt = long_prompt(LARGE, [50, 51])
    _, _, (item,) = llm._multimodal_prompt(prompt)
    assert item.offset < 32 < item.end
    llm.add_request("chunked", prompt, GREEDY)
    llm.step()
    assert llm.engine.scheduler.running[0].num_computed_tokens == item.offset
    outs = []
    while llm.engine.has_unfinished_requests():
        outs += llm.step()
    assert outs[-1].outputs[0].token_ids == hf_greedy(hf, llm, prompt)


def test_prefix_cache_same_image_hits_different_image_misses(llm, hf):
    """The repeated prompt's hit ends inside its image (at 32): the rest of the image is
    computed in one step, seeing the cached first half."""
    image = synthetic_image(64, 64, 11)
    first = long_prompt(image, [60, 61, 62])
    llm.generate(first, GREEDY, use_tqdm=False)
    _, _, (item,) = llm._multimodal_prompt(first)
    again = llm.generate(first, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 32 and item.offset < 32 < item.end
    assert again.outputs[0].token_ids == hf_greedy(hf, llm, first)
    other = long_prompt(synthetic_image(64, 64, 12), [60, 61, 62])
    miss = llm.generate(other, GREEDY, use_tqdm=False)[0]
    assert miss.num_cached_tokens <= item.offset  # the text before the image only
    assert miss.outputs[0].token_ids == hf_greedy(hf, llm, other)


def test_triton_attention_with_images(model_dir, hf):
    """The Triton kernels (interpreted on the CPU): the extend kernel reads the key limits,
    a text prompt beside the image prompt takes the same step."""
    prompts = [long_prompt(LARGE, [50, 51]), "The quick brown fox jumps over"]
    options = dict(dtype="float32", max_num_batched_tokens=32, block_size=16)
    with LLM(str(model_dir), attention_backend="triton", **options) as triton_llm:
        outs = triton_llm.generate(prompts, GREEDY, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            assert out.outputs[0].token_ids == hf_greedy(hf, triton_llm, prompt)


def test_chat_image_parts_and_the_server_front(llm, hf, model_dir):
    """``LLM.chat`` renders an image part as the begin-of-image token and expands it; the
    server's front takes a Gemma 3 chat's images (no longer refused) and expands them alike."""
    from heron.multimodal.media import MediaPolicy
    from heron.server.images import ServerImages

    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "The quick\n"},
                {"type": "image_pil", "image_pil": LARGE},
            ],
        }
    ]
    out = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    text = f"<|user|>The quick\n{IMAGE}<|end|><|assistant|>"
    prompt = {"prompt": text, "multi_modal_data": {"image": LARGE}}
    assert out.outputs[0].token_ids == hf_greedy(hf, llm, prompt)
    front = ServerImages(str(model_dir), MediaPolicy(), limit=1)
    conversation, images = front.take(messages)
    ids, items = front.process(llm.tokenizer.encode(text), images)
    assert (ids, items[0].content_hash) == (
        out.prompt_token_ids,
        llm._multimodal_prompt(prompt)[2][0].content_hash,
    )


def test_an_image_longer_than_a_step_is_refused(model_dir):
    with LLM(str(model_dir), dtype="float32", max_num_batched_tokens=3, max_num_seqs=2) as small:
        (out,) = small.generate(long_prompt(LARGE, [50]), GREEDY, use_tqdm=False)
        assert "an image of 4 tokens does not fit one step (max_num_batched_tokens=3)" in out.error


def test_the_published_checkpoint_layout_loads(model_dir, hf, tmp_path):
    """Gemma 3's published checkpoints nest the tower's weights under
    ``vision_tower.vision_model.``: the same weights so named give the same answers."""
    import shutil

    from safetensors.torch import load_file, save_file

    for file in model_dir.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, tmp_path / file.name)
    for file in model_dir.glob("*.safetensors"):
        tensors = {
            name.replace("vision_tower.", "vision_tower.vision_model.", 1): tensor
            for name, tensor in load_file(file).items()
        }
        save_file(tensors, tmp_path / file.name, metadata={"format": "pt"})
    with LLM(str(tmp_path), dtype="float32", max_num_batched_tokens=32) as published:
        prompt = {"prompt": f"The quick {IMAGE} brown fox", "multi_modal_data": {"image": SMALL}}
        (out,) = published.generate(prompt, GREEDY, use_tqdm=False)
        assert out.outputs[0].token_ids == hf_greedy(hf, published, prompt)


def test_preemption_recomputes_whole_images(model_dir, hf):
    """A pool too small for three image prompts at once: requests are preempted and resume
    (from their cached blocks, whose end may fall inside an image) with their images whole."""
    prompts = [
        long_prompt(synthetic_image(64, 64, 30 + seed), [50 + seed] * 6) for seed in range(3)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    options = dict(dtype="float32", max_num_batched_tokens=32, block_size=16, num_kv_blocks=9)
    with LLM(str(model_dir), max_model_len=96, **options) as small:
        outs = small.generate(prompts, params, use_tqdm=False)
        assert small.engine.scheduler.num_preemptions > 0
        cache = small.engine.runner.multimodal.cache
        assert len(cache) == 0 and cache.num_holders == 0
        for prompt, out in zip(prompts, outs):
            want = hf_greedy(hf, small, prompt, max_new=24)
            assert out.outputs[0].token_ids == want
