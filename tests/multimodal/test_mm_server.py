"""`heron serve` on a tiny Qwen3-VL: the real openai client sends images; bad image inputs
are refused with a 400 naming the problem, remote URLs only from allowed domains."""

from __future__ import annotations

import base64
import io
import socket

import openai
import pytest
import torch
import transformers as tf
from mm_models import hf_greedy_mm, save_qwen3_vl, synthetic_image
from server.openai_server import API_KEY, MODEL_NAME, openai_client, start_server, stop_server

SMALL, LARGE = synthetic_image(40, 56, 0), synthetic_image(64, 64, 1)


def data_url(image, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl"))


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("media")
    LARGE.save(path / "large.png")
    return path


@pytest.fixture(scope="module")
def server(model_dir, media_dir):
    handle = start_server(
        model_dir,
        "--api-key",
        API_KEY,
        "--dtype",
        "float32",
        "--limit-mm-per-prompt",
        '{"image": 2}',
        "--allowed-local-media-path",
        str(media_dir),
    )
    yield handle
    stop_server(handle)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def chat(client, content, max_tokens: int = 6):
    return client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens,
        temperature=0,
    )


def test_base64_and_local_images_match_hf(client, server, model_dir, media_dir):
    import httpx

    content = [
        {"type": "text", "text": "The quick"},
        image_part(data_url(SMALL)),
        image_part(f"file://{media_dir / 'large.png'}"),
    ]
    reply = chat(client, content)
    tokenized = httpx.post(
        f"{server.base_url}/tokenize",
        json={"messages": [{"role": "user", "content": content}]},
        headers={"Authorization": f"Bearer {API_KEY}"},
    ).json()["tokens"]
    hf = tf.Qwen3VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    processor = tf.Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    want = hf_greedy_mm(hf.eval(), processor, tokenized, [SMALL, LARGE], 6)
    tokenizer = tf.AutoTokenizer.from_pretrained(model_dir)
    # (the detokenizer holds back an incomplete UTF-8 sequence at the end)
    text = tokenizer.decode(want, skip_special_tokens=True).rstrip("\ufffd")
    assert reply.choices[0].message.content == text
    assert reply.usage.prompt_tokens == len(tokenized)


def refused(client, content) -> str:
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, content)
    return e.value.body["message"]


def test_bad_images_are_refused_by_name(client, media_dir, tmp_path):
    not_an_image = "data:image/png;base64," + base64.b64encode(b"not a png").decode()
    assert "not a decodable image" in refused(client, [image_part(not_an_image)])
    assert "not valid base64" in refused(client, [image_part("data:image/png;base64,@@@")])
    big = data_url(synthetic_image(80, 80, 3))
    assert "more than the image processor's maximum" in refused(client, [image_part(big)])
    three = [image_part(data_url(SMALL))] * 3
    assert "3 images, more than --limit-mm-per-prompt allows (2)" in refused(client, three)
    SMALL.save(tmp_path / "outside.png")
    outside = image_part(f"file://{tmp_path / 'outside.png'}")
    assert "not under the allowed local media path" in refused(client, [outside])
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    assert "'input_audio' are not supported" in refused(client, [audio])
    video = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}
    assert "'video_url' are not supported" in refused(client, [video])
    # The server still answers.
    assert chat(client, [{"type": "text", "text": "fox"}]).choices[0].message.content is not None


def test_url_of_a_domain_not_allowed_is_refused_without_connecting(client):
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.setblocking(False)
        port = listener.getsockname()[1]
        message = refused(client, [image_part(f"http://127.0.0.1:{port}/cat.png")])
        assert "domain '127.0.0.1' is not allowed" in message
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected
