"""Sleep mode: outputs after sleep and wake-up equal those before over every cache kind (paged,
two window groups, recurrent state, latent), with graph replays (emulated on the CPU) reading
the rebuilt buffers; memory released while asleep; 50 cycles leak nothing; bad calls refused
with the state intact."""

from __future__ import annotations

import gc

import pytest
import torch
from execution.view_replay import ViewReplay
from models.test_deepseek import v3_config
from models.test_gemma import FULL, SLIDING, gemma_config
from models.test_qwen3_5 import qwen3_5_config

from heron import LLM, SamplingParams
from heron.distributed.worker import WorkerSleep

from tiny_models import cuda_graph_llm, greedy_tokens, save_random_model, tiny_config

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
# The first two share a full 16-token block: the second hits the prefix cache.
PROMPTS = [list(range(10, 30)), list(range(10, 26)) + [200, 201], [3, 4, 5]]
OPTIONS = dict(enable_sleep_mode=True, max_model_len=64, num_kv_blocks=24, block_size=16)
CONFIGS = {
    "qwen3": lambda: tiny_config("qwen3"),
    "gemma3": lambda: _two_layers(gemma_config("gemma3"), [SLIDING, FULL]),
    "qwen3_5": qwen3_5_config,
    "deepseek_v3": v3_config,
}


def _two_layers(config, layer_types: list[str]):
    config.num_hidden_layers, config.layer_types = 2, layer_types
    return config


def emulate_graphs(llm: LLM) -> ViewReplay:
    """Decode steps replayed from graph buffers and captured views (see ViewReplay)."""
    runner = llm.engine.runner
    graphs = ViewReplay(runner.model, runner.plan, runner.device, 4, {})
    graphs.replayed = []
    graphs.capture(runner.block_size, runner.inputs.parts)
    runner.graphs = graphs
    return graphs


@pytest.mark.parametrize("family", CONFIGS)
def test_outputs_after_wake_up_equal_those_before(family, tmp_path):
    llm = LLM(str(save_random_model(CONFIGS[family](), tmp_path)), **OPTIONS)
    graphs = emulate_graphs(llm)
    greedy_tokens(llm, PROMPTS[:1], GREEDY)
    before = greedy_tokens(llm, PROMPTS, GREEDY)
    assert llm.engine.kv_cache.prefix_cache_hits > 0 and graphs.replayed

    assert llm.sleep(level=1) == []
    runner = llm.engine.runner
    assert llm.is_sleeping()
    assert all(p.numel() == 0 for p in runner.model.parameters())
    assert all(b.numel() == 0 for b in runner.model.buffers())  # RoPE tables, constants
    assert not graphs.graphs and not graphs.buffers and graphs.token_ids is None
    assert all(g.view is None for g in runner.plan.groups)

    llm.wake_up()
    assert not llm.is_sleeping()
    replayed = len(graphs.replayed)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == before
    assert outputs[0].num_cached_tokens == 0  # nothing cached before the sleep is hit
    assert len(graphs.replayed) > replayed  # decode steps replayed over the rebuilt buffers


@pytest.fixture
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir("qwen3")), **OPTIONS)


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_fifty_cycles_keep_outputs_and_leak_nothing(llm):
    """Level 1 and level 2 (weights reloaded from disk) alternate; host memory stays within
    8 MiB of its size after the first cycles (the model and its caches are ~1 MiB)."""
    before = greedy_tokens(llm, PROMPTS, GREEDY)
    engine = llm.engine
    for cycle in range(50):
        level = 1 + cycle % 2
        llm.sleep(level=level)
        engine.kv_cache.check_invariants()
        assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks - 1
        assert not engine.runner.requests
        llm.wake_up(["kv_cache"])
        llm.wake_up(["weights"])
        if level == 2:
            llm.reload_weights()
        if cycle % 10 == 9:  # (generation is the slow part on the CPU)
            assert greedy_tokens(llm, PROMPTS[:1], GREEDY) == before[:1]
        if cycle == 9:
            rss = _rss_kib()
    assert _rss_kib() - rss < 8 * 1024
    assert greedy_tokens(llm, PROMPTS, GREEDY) == before


def test_requests_while_asleep_or_before_weights_are_loaded_are_refused(llm):
    llm.sleep(level=2)
    with pytest.raises(RuntimeError, match="sleeping"):
        llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    llm.wake_up()
    with pytest.raises(RuntimeError, match="level-2 sleep discarded the weights"):
        llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    llm.reload_weights()
    assert greedy_tokens(llm, PROMPTS[:1], GREEDY)[0]


def test_sleep_with_requests_in_flight(llm):
    """Refused while a request runs (it runs on intact); with abort=True it is aborted."""
    want = greedy_tokens(llm, PROMPTS[:1], GREEDY)
    llm.add_request("r", PROMPTS[0], GREEDY, stream=False)
    llm.step()
    with pytest.raises(RuntimeError, match="1 requests are unfinished.*abort=True"):
        llm.sleep()
    assert not llm.is_sleeping()
    outputs = []
    while llm.has_unfinished_requests():
        outputs += llm.step()
    assert outputs[0].outputs[0].token_ids == want[0]

    llm.add_request("s", PROMPTS[0], GREEDY)
    llm.step()
    (aborted,) = llm.sleep(abort=True)
    assert aborted.request_id == "s" and aborted.outputs[0].finish_reason == "abort"
    assert not llm.has_unfinished_requests() and not llm.engine.runner.requests
    llm.wake_up()
    assert greedy_tokens(llm, PROMPTS[:1], GREEDY) == want


def test_bad_calls_are_refused(llm, tiny_model_dir):
    with pytest.raises(RuntimeError, match="not sleeping"):
        llm.wake_up()
    with pytest.raises(ValueError, match="sleep level must be 1 or 2, got 3"):
        llm.sleep(level=3)
    llm.sleep()
    with pytest.raises(RuntimeError, match="sleeping already"):
        llm.sleep()
    with pytest.raises(ValueError, match=r"tags must be among weights, kv_cache, got \['gpu'\]"):
        llm.wake_up(["gpu"])
    with pytest.raises(ValueError, match="must be a list"):
        llm.wake_up("weights")
    llm.wake_up(["kv_cache"])
    with pytest.raises(RuntimeError, match="cannot wake up kv_cache: it is awake already"):
        llm.wake_up(["kv_cache"])
    llm.wake_up(["weights"])
    plain = LLM(str(tiny_model_dir("qwen3")), max_model_len=64, num_kv_blocks=8)
    with pytest.raises(RuntimeError, match="enable_sleep_mode=True"):
        plain.sleep()


def test_a_tensor_parallel_worker_sleeps_as_rank_0_does(tiny_model_dir):
    """A worker's part (on a runner of its own here): released, then restored by tag, its
    step views rebuilt once the weights and caches are both back; level 2 brings zeros."""
    runner = LLM(str(tiny_model_dir("qwen3")), **OPTIONS).engine.runner
    sleep = WorkerSleep(runner, level=2)
    assert all(p.numel() == 0 for p in runner.model.parameters())
    assert all(owner.kv_cache is None for owner in runner.cache.owners)
    assert not sleep.wake_up(["weights"])
    assert all(not p.any() for p in runner.model.parameters())
    assert sleep.wake_up(["kv_cache"])
    assert all(owner.kv_cache is not None for owner in runner.cache.owners)


@pytest.mark.gpu
def test_device_memory_is_released_and_graphs_replay_after_wake_up(tiny_model_dir):
    """Level 2 gives back what the engine allocated (at least 95 %, as mem_get_info sees);
    the recaptured graphs replay over the reloaded weights and the new caches."""
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    llm = cuda_graph_llm(tiny_model_dir("qwen3"), enable_sleep_mode=True)
    graphs, replayed = llm.engine.runner.graphs, []
    run = graphs.run
    graphs.run = lambda seq: replayed.append(seq.num_reqs) or run(seq)
    before = greedy_tokens(llm, PROMPTS, GREEDY)
    held, free_awake = torch.cuda.memory_allocated() - base, torch.cuda.mem_get_info()[0]
    llm.sleep(level=2)
    assert torch.cuda.memory_allocated() - base <= 0.05 * held
    assert torch.cuda.mem_get_info()[0] - free_awake >= 0.95 * held
    llm.wake_up()
    llm.reload_weights()
    count = len(replayed)
    assert greedy_tokens(llm, PROMPTS, GREEDY) == before
    assert len(replayed) > count
