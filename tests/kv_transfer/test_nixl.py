"""The nixl connector between two engines of one process (NIXL over UCX's TCP transport):
a decode engine that reads each prompt's blocks from a prefill engine produces HF's greedy
tokens (a dense model, Gemma 3's window and full groups, DeepSeek-V3's latent cache), the
prompt counted as cached; the prefill side frees what was read; neither side leaks. A hybrid
model (Qwen3.5) reads its recurrent state with the blocks."""

from __future__ import annotations

import time

import pytest
from test_offload import (
    CONFIGS,
    MAX_NEW,
    PREFIXES,
    PROMPTS,
    SMALL,
    check_leak_free,
    metric,
    models,
)

from heron import SamplingParams
from heron.config import EngineConfig
from heron.engine.llm_engine import LLMEngine
from heron.kv_transfer import TransferResults
from heron.kv_transfer.nixl_agent import LayerRegion, descriptors

from tiny_models import QWEN3_5, hf_greedy, save_random_model

pytest.importorskip("nixl._api", reason="the nixl connector needs nixl (heron[pd])")

__all__ = ["models"]  # (the fixture, shared with the offload tests)


def _wait_released(prefill: LLMEngine) -> None:
    """Until the read's notification has freed the prefill engine's held blocks."""
    deadline = time.monotonic() + 10
    while prefill.scheduler.held:
        assert time.monotonic() < deadline, "the prefill engine holds the blocks still"
        prefill.scheduler.release_held()
        time.sleep(0.01)


def _run(engine: LLMEngine, prompt: list[int], params: SamplingParams):
    """The request's tokens and its final delta."""
    engine.add_request("r", prompt, params)
    tokens = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens += delta.samples[0].token_ids if delta.samples else []
            if delta.finished:
                return tokens, delta
    raise AssertionError("the request did not finish")


@pytest.mark.parametrize("family", list(CONFIGS))
def test_a_decode_engine_reads_the_prompt_of_a_prefill_engine(
    models, family, monkeypatch, nixl_engine
):
    monkeypatch.setenv("UCX_TLS", "tcp")
    path, want = models(family)
    prefill, decode = nixl_engine(path, "prefill"), nixl_engine(path, "decode")
    first = SamplingParams(
        temperature=0.0, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
    )
    got, read = [], []
    # Three prefixes, each read whole; then the last one's first 41 tokens, whose 5 blocks
    # before the last token the decode engine holds: nothing is read, the prefill side is told.
    for prompt in [*PROMPTS[:3], PROMPTS[2][:41]]:
        _, answer = _run(prefill, prompt, first)
        assert prefill.scheduler.held  # kept for the decode engine
        params = SamplingParams(
            temperature=0.0,
            max_tokens=MAX_NEW,
            ignore_eos=True,
            kv_transfer_params=answer.kv_transfer_params,
        )
        tokens, delta = _run(decode, prompt, params)
        got.append(tokens)
        read.append(metric(decode, "kv_transfer_blocks"))
        assert delta.num_cached_tokens == len(prompt) - 1  # all but the last, which it samples
        _wait_released(prefill)  # freed once the read's notification arrives
    assert got[:3] == want[:3]
    assert read[0] >= 6 and read[2] == 3 * read[0] and read[3] == read[2]
    assert metric(decode, "kv_transfer_failed_loads") == 0
    assert metric(prefill, "kv_transfer_held_blocks") == 0
    check_leak_free(prefill)
    check_leak_free(decode)


# Two prompts sharing 40 tokens (5 blocks), another, and its 40 tokens and one more (the
# state to keep: after 40 tokens, where the prefill engine's prefix hit ends).
HYBRID_PROMPTS = [PROMPTS[0], PROMPTS[3], PROMPTS[1], PREFIXES[1] + [11]]


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    """A tiny Qwen3.5 (recurrent and full-attention layers) and HF's greedy tokens."""
    import torch
    import transformers as tf

    path = save_random_model(tf.Qwen3_5TextConfig(**QWEN3_5), tmp_path_factory.mktemp("q"))
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return path, hf_greedy(hf, HYBRID_PROMPTS, MAX_NEW)


def test_a_hybrid_model_reads_the_recurrent_state_with_the_blocks(
    qwen3_5, monkeypatch, nixl_engine
):
    """The prefill engine (chunks of 16 tokens) keeps the state after all but the prompt's
    last token, also where a prefix hit ends there or just before; the decode engine reads it
    with the attention blocks, also past a prefix hit of its own, and continues as HF does."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    path, want = qwen3_5
    chunked = SMALL | dict(max_num_batched_tokens=16)
    prefill, decode = (
        nixl_engine(path, "prefill", **chunked),
        nixl_engine(path, "decode", **chunked),
    )
    assert prefill.scheduler.connector.handshake()["kv_transfer_mode"] == "whole"  # (default)
    first = SamplingParams(
        temperature=0.0, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    # (the decode engine's own first: the next two hit its prefix)
    assert _run(decode, HYBRID_PROMPTS[0], greedy)[0] == want[0]
    got = []
    for prompt in HYBRID_PROMPTS:
        _, answer = _run(prefill, prompt, first)
        params = greedy.clone()
        params.kv_transfer_params = answer.kv_transfer_params
        tokens, delta = _run(decode, prompt, params)
        got.append(tokens)
        assert delta.num_cached_tokens == len(prompt) - 1
        _wait_released(prefill)
    assert got == want
    assert metric(decode, "kv_transfer_failed_loads") == 0
    assert metric(prefill, "kv_transfer_held_blocks") == 0
    check_leak_free(prefill)
    check_leak_free(decode)


def test_a_hybrid_model_refuses_layerwise_transfer(qwen3_5):
    """A recurrent state is complete only after the prompt: it cannot move layer by layer."""
    path, _ = qwen3_5
    nixl = {
        "kv_connector": "nixl",
        "kv_role": "prefill",
        "kv_connector_extra_config": {"kv_transfer_mode": "layerwise"},
    }
    with pytest.raises(ValueError, match="kv_transfer_mode 'layerwise' cannot move cache group"):
        LLMEngine(EngineConfig(str(path), kv_transfer_config=nixl, **SMALL))


@pytest.mark.parametrize("policy", ["recompute", "abort"])
def test_a_failed_read_is_recomputed_or_fails_the_request(models, policy, monkeypatch, nixl_engine):
    """A prefill instance gone (agent metadata nobody can reach): the decode engine computes
    the prompt itself, or (``on_read_failure: "abort"``) ends the request at once with an
    error saying why; the prefill engine frees the unread blocks at its timeout."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    path, want = models("llama")
    prefill = nixl_engine(path, "prefill", {"hold_timeout_s": 0.2})
    decode = nixl_engine(path, "decode", {"on_read_failure": policy})
    first = SamplingParams(
        temperature=0.0, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
    )
    _, answer = _run(prefill, PROMPTS[0], first)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=MAX_NEW,
        ignore_eos=True,
        kv_transfer_params=answer.kv_transfer_params
        | {"remote_engine_id": "gone", "remote_agent_metadata": "AAAA"},
    )
    tokens, delta = _run(decode, PROMPTS[0], params)
    if policy == "recompute":
        assert tokens == want[0] and delta.error is None
    else:
        assert tokens == [] and delta.samples[0].finish_reason == "abort"
        assert "the KV read from the prefill instance failed" in delta.error
    assert metric(decode, "kv_transfer_failed_loads") == 1
    check_leak_free(decode)
    time.sleep(0.2)
    _wait_released(prefill)
    assert metric(prefill, "kv_transfer_hold_timeouts") == 1
    check_leak_free(prefill)


def test_a_request_aborted_while_its_read_is_in_flight_keeps_its_blocks_until_it_ends(
    models, monkeypatch, nixl_engine
):
    """The READ may still write the blocks: they are freed once it ended, not at the abort
    (where another request could be given them); the read still frees the prefill side's."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    path, _ = models("llama")
    prefill, decode = nixl_engine(path, "prefill"), nixl_engine(path, "decode")
    first = SamplingParams(
        temperature=0.0, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
    )
    _, answer = _run(prefill, PROMPTS[0], first)
    worker = decode.runner.kv_connector
    take_results = worker.take_results
    monkeypatch.setattr(worker, "take_results", TransferResults)  # (the read seems to run on)
    params = SamplingParams(max_tokens=MAX_NEW, kv_transfer_params=answer.kv_transfer_params)
    decode.add_request("r", PROMPTS[0], params)
    decode.step()
    assert "r" in decode.scheduler.loading
    decode.abort_request("r")
    assert "r" in decode.scheduler.draining and decode.keeps_blocks()
    pool = decode.kv_cache.groups[0]
    assert pool.num_free_blocks < pool.num_blocks - 1
    monkeypatch.setattr(worker, "take_results", take_results)
    deadline = time.monotonic() + 10
    while decode.keeps_blocks():
        assert time.monotonic() < deadline, "the read never ended"
        decode.release_blocks()
        time.sleep(0.01)
    check_leak_free(decode)
    _wait_released(prefill)
    check_leak_free(prefill)


def test_blocks_consecutive_on_both_sides_move_as_one_descriptor():
    ours = LayerRegion(1000, 2, 8, 10, "float32", 0, "DRAM", 0)  # (two runs: K and V)
    theirs = LayerRegion(5000, 2, 16, 10, "float32", 0, "DRAM", 0)
    local, remote = descriptors(ours, theirs, [(1, 4), (2, 5), (3, 6), (5, 7), (6, 9)])
    # Runs (1-3 -> 4-6), (5 -> 7), (6 -> 9), in each of the two prefixes.
    assert local == [(1010, 30, 0), (1050, 10, 0), (1060, 10, 0)] + [
        (1090, 30, 0),
        (1130, 10, 0),
        (1140, 10, 0),
    ]
    assert remote == [(5040, 30, 0), (5070, 10, 0), (5090, 10, 0)] + [
        (5200, 30, 0),
        (5230, 10, 0),
        (5250, 10, 0),
    ]
