"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) answers a known question."""

import pytest

from heron import LLM, SamplingParams


@pytest.mark.slow
def test_default_model_knows_the_capital_of_france(tmp_path, monkeypatch):
    monkeypatch.setenv(
        "HERON_CACHE_DIR", str(tmp_path)
    )  # convert from scratch, not the user's cache
    llm = LLM()
    assert llm.engine.model_config.architecture == "LlamaForCausalLM"
    question = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(question, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # the model ends its turn by itself
