"""The RL routes of a server in sleep mode, driven as a trainer does, with the real openai client
generating before and after: sleep and wake-up, a weight reload from another checkpoint and a
broadcast of its tensors from a trainer process over gloo (outputs HF's), pause and resume;
503 while asleep or paused, 409 for calls out of turn."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
import transformers as tf
from distributed.test_weight_sync import TRAINER, chunks
from ports import free_port

from openai_server import MODEL_NAME
from tiny_models import hf_greedy, save_tiny_model

PROMPT = [5, 17, 33, 2, 41, 9]


def complete(client: openai.OpenAI) -> str:
    out = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    return out.choices[0].text


def refused(client: openai.OpenAI, message: str) -> None:
    with pytest.raises(openai.APIStatusError) as e:
        complete(client)
    assert e.value.status_code == 503 and message in e.value.message


@pytest.fixture
def awake(server, http):
    """Whatever a test leaves, the server is awake, unpaused and on its own weights after."""
    yield
    if http.get("/is_sleeping").json()["is_sleeping"]:
        http.post("/wake_up")
    http.post("/update_weights_from_disk", json={})
    http.post("/resume_generation")


def test_sleep_wake_up_and_reload_weights(server, client, http, awake, tmp_path):
    before = complete(client)
    assert httpx.post(f"{server.base_url}/sleep").status_code == 401  # (no API key)

    assert http.post("/sleep", params={"level": 1}).json() == {"success": True, "num_aborted": 0}
    assert http.get("/health").json() == {"status": "sleeping"}
    assert http.get("/is_sleeping").json() == {"is_sleeping": True}
    refused(client, "sleeping")
    assert http.post("/sleep").status_code == 409
    assert http.post("/wake_up", params={"tags": ["gpu"]}).status_code == 400
    assert http.post("/wake_up", params={"tags": ["weights"]}).status_code == 200
    assert http.post("/wake_up", params={"tags": ["kv_cache"]}).status_code == 200
    assert http.get("/health").status_code == 200 and not http.get("/health").content
    assert complete(client) == before

    second = save_tiny_model("qwen2", tmp_path, seed=1)
    http.post("/sleep", params={"level": 2}).raise_for_status()
    http.post("/wake_up").raise_for_status()
    refused(client, "level-2 sleep discarded the weights")
    reloaded = http.post("/update_weights_from_disk", json={"model_path": str(second)})
    assert reloaded.json()["success"]
    hf = tf.AutoModelForCausalLM.from_pretrained(second, dtype=torch.float32)
    want = tf.AutoTokenizer.from_pretrained(second).decode(hf_greedy(hf, [PROMPT], 6)[0])
    assert complete(client) == want
    missing = http.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "no")})
    assert missing.status_code == 400 and "not a checkpoint directory" in missing.text
    http.post("/update_weights_from_disk", json={}).raise_for_status()
    assert complete(client) == before


def test_pause_and_resume(client, http, awake):
    before = complete(client)
    assert http.post("/pause_generation", params={"mode": "abort"}).json()["success"]
    refused(client, "paused")
    assert http.post("/pause_generation").status_code == 409
    assert http.post("/reset_prefix_cache").json() == {"success": True}
    http.post("/resume_generation").raise_for_status()
    assert http.post("/resume_generation").status_code == 409
    assert complete(client) == before


def test_update_weights_from_a_trainer_process(client, http, awake, tmp_path):
    second = save_tiny_model("qwen2", tmp_path, seed=1)
    port = free_port()
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(second), str(port)])
    group = dict(master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2)
    try:
        with ThreadPoolExecutor(1) as pool:  # (the call returns once the trainer joined)
            joined = pool.submit(
                http.post, "/init_weight_update_group", json=group | {"backend": "gloo"}
            )
            assert joined.result().json() == {"success": True}
        for chunk in chunks(second):
            updated = http.post("/update_weights_from_distributed", json=chunk).json()
            assert updated == {"success": True, "num_tensors": len(chunk["names"])}
        assert trainer.wait(timeout=60) == 0
    finally:
        trainer.kill()
    hf = tf.AutoModelForCausalLM.from_pretrained(second, dtype=torch.float32)
    want = tf.AutoTokenizer.from_pretrained(second).decode(hf_greedy(hf, [PROMPT], 6)[0])
    assert complete(client) == want
