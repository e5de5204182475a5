"""The compatibility fallback (a platform that collects no operator metadata): it serves every
in-tree operator whose window the model config names, and refuses, with the reason, a model
whose layers' windows differ."""

from __future__ import annotations

import pytest
from test_gemma import save_gemma

import heron.engine.resolved_config as resolved_config
from heron import LLM, SamplingParams
from heron.metadata import StepMetadataError
from heron.platforms import Platform

PROMPTS = [[(i * 37) % 300 + 5 for i in range(40)], [3, 4, 5]]  # the first passes the window
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
OPTIONS = dict(device="cpu", max_model_len=64, max_num_seqs=4, enable_prefix_caching=False)


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def test_triton_operator_runs_on_the_fallback(tiny_model_dir, monkeypatch):
    """The fallback's views have no split workspace: the Triton operator decodes in one split
    and gives the tokens it gives with its own builder (Mistral: one window for every layer)."""
    path = str(tiny_model_dir("mistral"))
    expected = _tokens(LLM(path, attention_backend="triton", **OPTIONS))
    monkeypatch.setattr(resolved_config, "platform_for", lambda device: Platform(device))
    llm = LLM(path, attention_backend="triton", **OPTIONS)
    (group,) = llm.engine.runner.plan.groups
    assert group.is_fallback
    assert _tokens(llm) == expected


def test_fallback_refuses_layers_whose_window_differs(tmp_path, monkeypatch):
    """Gemma 2 alternates sliding and full layers: one model-wide window is wrong for half of
    them, so the plan refuses the fallback, naming a layer and why."""
    path = str(save_gemma("gemma2", tmp_path))
    monkeypatch.setattr(resolved_config, "platform_for", lambda device: Platform(device))
    with pytest.raises(StepMetadataError, match=r"layers\.1\.self_attn.*compatibility fallback"):
        LLM(path, **OPTIONS)
