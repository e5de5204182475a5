"""LoRA adapters over the OpenAI API: --lora-modules, adapters selected by the request's model
through the real openai client (outputs equal HF + PEFT's), /v1/models, load and unload at run
time, and the errors of each."""

from __future__ import annotations

import json
import shutil

import httpx
import openai
import peft
import pytest
import torch
import transformers as tf

from heron import SamplingParams
from heron.engine.detokenizer import IncrementalDetokenizer

from openai_server import API_KEY, MODEL_NAME, openai_client, start_server, stop_server
from tiny_models import hf_greedy, save_random_adapter

PROMPT = list(range(10, 30))
MAX_NEW = 6
PARAMS = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]


def _greedy_text(base, adapter=None) -> str:
    """HF + PEFT's greedy continuation of the prompt."""
    model = tf.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    tokens = hf_greedy(model.eval(), [PROMPT], MAX_NEW)[0]
    # The tokens' text as the server writes it (an incomplete last character held back).
    text = IncrementalDetokenizer(tf.AutoTokenizer.from_pretrained(base), PROMPT, PARAMS)
    text.update(tokens)
    return text.text


@pytest.fixture(scope="module")
def lora_server(tiny_model_dir, tmp_path_factory):
    """A server of the tiny Qwen3 model with adapter ``a`` from the start; adapter ``b`` and
    one of too high a rank to load later; each one's (and the base model's) greedy text."""
    base = tiny_model_dir("qwen3")
    tmp = tmp_path_factory.mktemp("served-adapters")
    a = save_random_adapter(base, tmp / "a", 3, 8, TARGETS, lora_alpha=16)
    b = save_random_adapter(base, tmp / "b", 4, 4, TARGETS, lora_alpha=4)
    big = shutil.copytree(b, tmp / "big")  # b, said to be of rank 16
    config = big / "adapter_config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | {"r": 16}))
    texts = {"a": _greedy_text(base, a), "b": _greedy_text(base, b), None: _greedy_text(base)}
    handle = start_server(
        base,
        "--api-key",
        API_KEY,
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "8",
        "--lora-modules",
        f"a={a}",
    )
    yield handle, {"b": b, "big": big}, texts
    stop_server(handle)


def _complete(client: openai.OpenAI, model: str) -> str:
    completion = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=MAX_NEW,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    return completion.choices[0].text


def test_adapters_selected_by_model_load_and_unload(lora_server):
    handle, paths, texts = lora_server
    client = openai_client(handle)
    http = httpx.Client(
        base_url=handle.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
    )
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {MODEL_NAME, "a"}
    assert cards["a"].parent == MODEL_NAME
    assert _complete(client, "a") == texts["a"] != texts[None]
    assert _complete(client, MODEL_NAME) == texts[None]
    with pytest.raises(openai.NotFoundError, match="'b'"):
        _complete(client, "b")

    loaded = http.post(
        "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(paths["b"])}
    )
    assert loaded.status_code == 200, loaded.text
    assert {m.id for m in client.models.list().data} == {MODEL_NAME, "a", "b"}
    assert _complete(client, "b") == texts["b"]
    again = http.post(
        "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(paths["b"])}
    )
    assert again.status_code == 400 and "already loaded" in again.text

    too_big = http.post(
        "/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": str(paths["big"])}
    )
    assert too_big.status_code == 400 and "max_lora_rank=8" in too_big.text
    assert "big" not in {m.id for m in client.models.list().data}

    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "b"}).status_code == 200
    with pytest.raises(openai.NotFoundError, match="'b'"):
        _complete(client, "b")
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "b"}).status_code == 404
    assert _complete(client, "a") == texts["a"]  # the others are served on
