"""The nixl connector between two engines of one process (NIXL over UCX's TCP transport):
a decode engine that reads each prompt's blocks from a prefill engine produces HF's greedy
tokens (a dense model, Gemma 3's window and full groups, DeepSeek-V3's latent cache), the
prompt counted as cached; the prefill side frees what was read; neither side leaks. Recurrent
states are refused by name."""

from __future__ import annotations

import time

import pytest
from test_offload import CONFIGS, MAX_NEW, PROMPTS, SMALL, check_leak_free, metric, models

from heron import SamplingParams
from heron.config import EngineConfig
from heron.engine.llm_engine import LLMEngine

from tiny_models import QWEN3_5, save_random_model

pytest.importorskip("nixl._api", reason="the nixl connector needs nixl (heron[pd])")

__all__ = ["models"]  # (the fixture, shared with the offload tests)


def _engine(path, role: str) -> LLMEngine:
    nixl = {"kv_connector": "nixl", "kv_role": role}
    return LLMEngine(EngineConfig(str(path), kv_transfer_config=nixl, **SMALL))


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
def test_a_decode_engine_reads_the_prompt_of_a_prefill_engine(models, family, monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp")
    path, want = models(family)
    prefill, decode = _engine(path, "prefill"), _engine(path, "decode")
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
        deadline = time.monotonic() + 10
        while prefill.scheduler.held:  # freed once the read's notification arrives
            assert time.monotonic() < deadline, "the prefill engine holds the blocks still"
            prefill.scheduler.release_held()
            time.sleep(0.01)
    assert got[:3] == want[:3]
    assert read[0] >= 6 and read[2] == 3 * read[0] and read[3] == read[2]
    assert metric(decode, "kv_transfer_failed_loads") == 0
    assert metric(prefill, "kv_transfer_held_blocks") == 0
    check_leak_free(prefill)
    check_leak_free(decode)


def test_recurrent_states_are_refused_by_name(tmp_path, monkeypatch):
    import transformers as tf

    monkeypatch.setenv("UCX_TLS", "tcp")
    path = save_random_model(tf.Qwen3_5TextConfig(**QWEN3_5), tmp_path)
    with pytest.raises(ValueError, match="'nixl' connector cannot transfer cache group"):
        _engine(path, "decode")
