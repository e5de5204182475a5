"""A runner fed only pickled step plans computes what the engine's own runner computed."""

from __future__ import annotations

import pickle

import torch

from heron import LLM, SamplingParams
from heron.execution.model_runner import ModelRunner


def test_a_runner_runs_from_pickled_plans_alone(tiny_model_dir):
    # A small pool and chunked prefill: the plans carry preemptions, resumed tables and
    # finished requests; one request is seeded, one wants prompt logprobs.
    options = dict(max_model_len=96, num_kv_blocks=14, block_size=8, max_num_batched_tokens=24)
    engine = LLM(str(tiny_model_dir("llama")), async_scheduling=False, **options).engine
    plans, outputs = [], []
    launch = engine.runner.launch

    def record(plan, previous=None, drafts=None):
        launched = launch(plan, previous, drafts)
        plans.append(pickle.dumps(plan))
        outputs.append(launched.result())
        return launched

    engine.runner.launch = record
    for i in range(5):
        params = SamplingParams(temperature=0, max_tokens=12 + 3 * i, ignore_eos=True)
        if i == 1:
            params = SamplingParams(temperature=0.9, seed=5, max_tokens=14, ignore_eos=True)
        if i == 2:
            params = SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=2)
        engine.add_request(f"r{i}", [(i * 31 + j) % 250 + 3 for j in range(10 + 6 * i)], params)
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()  # idle: its plan only tells the runner the last requests are gone
    assert engine.scheduler.num_preemptions > 0 and not engine.runner.requests

    config = engine.model_config
    runner = ModelRunner(config, engine.platform, engine.block_size, "reference", seed=0)
    runner.allocate_kv_cache(engine.runner.num_blocks)
    for payload, expected in zip(plans, outputs):
        got = runner.launch(pickle.loads(payload)).result()
        assert got.request_ids == expected.request_ids
        assert got.token_ids == expected.token_ids
        assert got.prompt_logprobs.keys() == expected.prompt_logprobs.keys()
        for key, lps in got.prompt_logprobs.items():
            for a, b in zip(lps, expected.prompt_logprobs[key], strict=True):
                assert a.token_id == b.token_id
                torch.testing.assert_close(a.logprob, b.logprob)
    assert not runner.requests  # every request was finished by a later plan
