"""Engine behaviour end to end on a tiny model: leaks, aborts, bad input, n, seeds, stops."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import transformers as tf

from heron import LLM, SamplingParams
from heron.metadata import ModelBuildContext, StepMetadataError
from heron.ops.attention.base import AttentionSpec
from heron.ops.attention.reference import ReferenceAttention


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir("qwen2")), max_model_len=128, num_kv_blocks=40)


def _assert_pool_idle(llm: LLM) -> None:
    kv = llm.engine.kv_cache
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks - 1
    assert kv.usage == 0.0
    assert not llm.engine.has_unfinished_requests()


def test_no_block_leak_after_finish_and_abort(llm):
    params = SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True, seed=1)
    for i in range(6):
        llm.add_request(f"leak-{i}", list(range(5, 25 + 7 * i)), params)
    for _ in range(5):
        llm.step()
    assert llm.engine.kv_cache.usage > 0
    llm.abort_request("leak-1")
    aborted = llm.abort_request("leak-4")
    assert aborted.outputs[0].finish_reason == "abort"
    while llm.has_unfinished_requests():
        llm.step()
    _assert_pool_idle(llm)


def test_bad_prompts_rejected_alone(llm):
    params = SamplingParams(temperature=0, max_tokens=5)
    outputs = llm.generate(
        [[1, 2, 3], [], list(range(5, 200)), [1, 99999], "hello world"], params, use_tqdm=False
    )
    assert [o.error is None for o in outputs] == [True, False, False, False, True]
    assert "empty" in outputs[1].error
    assert "195 tokens" in outputs[2].error and "max_model_len=128" in outputs[2].error
    assert "99999" in outputs[3].error
    assert len(outputs[0].outputs[0].token_ids) == 5 and outputs[4].outputs[0].text
    _assert_pool_idle(llm)


def test_engine_add_request_raises_and_queues_nothing(llm):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.engine.add_request("bad", [-1], SamplingParams())
    assert not llm.engine.has_unfinished_requests()


def test_seed_reproducible_whatever_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, ignore_eos=True, seed=123)
    other = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    prompt = [10, 11, 12, 13]
    alone = llm.generate(prompt, seeded, use_tqdm=False)[0].outputs[0].token_ids
    batch = llm.generate(
        [[40, 41], prompt, [50, 51, 52, 53, 54, 55]], [other, seeded, other], use_tqdm=False
    )
    assert batch[1].outputs[0].token_ids == alone


def test_n_samples_share_prompt_blocks(llm):
    kv = llm.engine.kv_cache
    hits = kv.prefix_cache_hits
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, ignore_eos=True, seed=7)
    prompt = list(range(100, 150))  # three full blocks
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # distinct samples
    # The later samples found the first one's prompt blocks.
    assert kv.prefix_cache_hits - hits >= 2 * 48
    again = llm.generate(prompt, params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    _assert_pool_idle(llm)


def test_stop_string_and_stop_token(llm):
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompt = "The quick brown fox"
    full = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0]
    stop = full.text[6:9]
    assert len(stop) == 3
    cut = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop])
    out = llm.generate(prompt, cut, use_tqdm=False)[0].outputs[0]
    assert out.text == full.text[: full.text.index(stop)]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    keep = SamplingParams(
        temperature=0, max_tokens=20, ignore_eos=True, stop=[stop], include_stop_str_in_output=True
    )
    out = llm.generate(prompt, keep, use_tqdm=False)[0].outputs[0]
    assert out.text == full.text[: full.text.index(stop) + len(stop)]

    stop_id = full.token_ids[4]
    by_id = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_id])
    out = llm.generate(prompt, by_id, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full.token_ids[: full.token_ids.index(stop_id) + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    _assert_pool_idle(llm)  # a stop string's sample was aborted in the engine, its blocks freed


def test_length_limits(llm):
    out = llm.generate([5] * 120, SamplingParams(max_tokens=50, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8  # prompt + output fill max_model_len=128
    assert out[0].outputs[0].finish_reason == "length"


def test_logprobs_equal_hf_log_softmax(llm, tiny_model_dir):
    hf = tf.AutoModelForCausalLM.from_pretrained(tiny_model_dir("qwen2"), dtype=torch.float32)
    prompt = [7, 8, 9, 10, 11]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=4)
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    ids = prompt + out.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    for step, lp in enumerate(out.logprobs):
        row = ref[len(prompt) - 1 + step]
        assert lp.token_id == out.token_ids[step] and lp.rank == 1
        assert lp.logprob == pytest.approx(row[lp.token_id].item(), abs=1e-4)
        assert set(lp.top) == set(row.topk(4).indices.tolist())


def test_chat_applies_template(llm):
    messages = [{"role": "user", "content": "hi"}]
    ids = llm.apply_chat_template(messages)
    assert llm.tokenizer.decode(ids) == "<|user|>hi<|end|><|assistant|>"
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids and len(out.outputs[0].token_ids) <= 4


def test_engine_checks_coverage_before_first_step(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), max_model_len=64, num_kv_blocks=8)
    with ModelBuildContext():  # registered, but in a scope no plan was made from
        stray = ReferenceAttention("extra.attn", AttentionSpec(4, 2, 16, 0.25), 16, 64)
    llm.engine.runner.model.model.layers[0].add_module("extra", stray)
    out = None
    with pytest.raises(StepMetadataError, match="extra.attn"):
        out = llm.generate([1, 2, 3], SamplingParams(max_tokens=2), use_tqdm=False)
    assert out is None


def test_start_up_heap_is_frozen_out_of_the_collector(llm):
    """The server freezes the engine's start-up objects (model, tokenizer, graphs) into the
    collector's permanent generation, so a full garbage collection while serving does not walk
    them; an engine used offline is left to the caller's collector."""
    from heron.engine.core_launch import freeze_start_up_heap

    model = llm.engine.runner.model
    freeze_start_up_heap()
    try:
        assert gc.get_freeze_count() > 0
        assert not any(o is model for o in gc.get_objects())
    finally:
        gc.unfreeze()


def test_a_deleted_engine_frees_its_model_and_cache(tiny_model_dir):
    """Frozen objects are never collected as cyclic garbage, so an engine must not hold its
    model or KV cache in a reference cycle: dropping the last reference frees them."""
    llm = LLM(str(tiny_model_dir("qwen2")), max_model_len=128, num_kv_blocks=40)
    llm.generate(["hello"], SamplingParams(max_tokens=3), use_tqdm=False)
    model = weakref.ref(llm.engine.runner.model)
    cache = weakref.ref(llm.engine.runner.cache.owners[0].kv_cache)
    del llm
    gc.collect()
    assert model() is None and cache() is None


def test_shutdown_and_the_context_manager(tiny_model_dir):
    path = str(tiny_model_dir("qwen2"))
    with LLM(path, max_model_len=128, num_kv_blocks=40) as llm:
        (output,) = llm.generate("hello", SamplingParams(max_tokens=3), use_tqdm=False)
        assert output.finished
        engine = weakref.ref(llm.engine)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate("hello", use_tqdm=False)
    llm.shutdown()  # once is enough; again changes nothing
    gc.collect()
    assert engine() is None  # the LLM no longer holds its engine


def test_abort_one_sample_and_no_detokenizer(tiny_model_dir):
    """The engine returns token deltas, no text: stop strings are its caller's (the output
    processor's), which stops one sample through ``abort_request``."""
    from heron.config import EngineConfig
    from heron.engine.deltas import SampleDelta
    from heron.engine.llm_engine import LLMEngine

    config = EngineConfig(str(tiny_model_dir("qwen2")), max_model_len=128, num_kv_blocks=40)
    engine = LLMEngine(config)
    params = SamplingParams(n=2, temperature=0, max_tokens=6, ignore_eos=True, stop=["a"])
    engine.add_request("r", [5, 6, 7], params)
    deltas = engine.step()
    aborted = engine.abort_request("r", sample_index=0)
    assert [(s.index, s.finish_reason) for s in aborted.samples] == [(0, "abort")]
    assert not aborted.finished  # the second sample runs on
    deltas.append(aborted)
    while engine.has_unfinished_requests():
        deltas += engine.step()
    reasons = {s.index: s.finish_reason for d in deltas for s in d.samples if s.finish_reason}
    assert reasons == {0: "abort", 1: "length"} and deltas[-1].finished

    def tokens(index: int) -> list[int]:
        return [t for d in deltas for s in d.samples if s.index == index for t in s.token_ids]

    assert len(tokens(1)) == 6 and len(tokens(0)) < 6
    assert "text" not in SampleDelta.__struct_fields__  # the caller detokenizes (and matches "a")
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks - 1
    assert engine.abort_request("r") is None


@pytest.mark.gpu
def test_a_dropped_engine_leaves_its_memory_to_the_next(tiny_model_dir):
    """An engine dropped while a reference cycle still holds it (no collection since) keeps
    its KV cache allocated; the next engine's memory profile must not count it as its own."""
    path = str(tiny_model_dir("qwen2"))
    first = LLM(path, device="cuda", max_model_len=128, gpu_memory_utilization=0.4)
    first.engine.cycle = first  # what closures over an engine make
    del first  # not collected: its cache stays allocated until the next collection
    second = LLM(path, device="cuda", max_model_len=128, gpu_memory_utilization=0.4)
    blocks = second.engine.kv_cache.group_usage()[0].num_blocks
    second.shutdown()
    del second
    gc.collect()
    # The first engine's cache was not counted: the second got what an engine alone gets.
    alone = LLM(path, device="cuda", max_model_len=128, gpu_memory_utilization=0.4)
    assert blocks > 1000 and blocks >= 0.98 * alone.engine.kv_cache.group_usage()[0].num_blocks
