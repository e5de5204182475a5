"""Asynchronous verification: a draft model's verification step is left on the device, and the
next step and its draft pass are scheduled before it is read, as if it accepted every
proposal, then moved back on the device by its refusals. Greedy output equals plain greedy
decoding token for token (fp32, CPU; stop strings, ``max_tokens`` inside an accepted block, an
abort while a verification is on the device, the Triton attention operator), seeded sampling
equals the synchronous verification's (``async_scheduling`` off), both pools give every block
back, and a configuration whose operators read host lengths stays synchronous, saying why.
Chunked prefill, prefix hits and preemption: tests/models/test_draft_model_parity.py, which
runs this path by default."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers as tf
from test_device_drafts import CUDA_OPTIONS, PROMPTS, draft_llm, graph_replays

from heron import LLM, SamplingParams
from heron.execution.launched import LaunchedStep
from heron.execution.next_decode import DecodeChainer
from heron.execution.verify import Verifier

from tiny_models import first_divergence_is_a_near_tie, save_tiny_model, save_truncated_draft

K = 3  # (the drafts' num_speculative_tokens)
AHEAD = "as if it accepted every proposal"


@pytest.fixture(scope="module")
def models(tiny_model_dir, tmp_path_factory):
    target = tiny_model_dir("llama")
    return str(target), str(save_truncated_draft(target, tmp_path_factory.mktemp("draft")))


def outputs(llm: LLM, params) -> list[tuple[list[int], str, str]]:
    done = llm.generate(PROMPTS, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in done]


def assert_pools_empty(llm: LLM) -> None:
    for kv in (llm.engine.kv_cache, llm.engine.proposer.kv_cache):
        kv.check_invariants()
        assert kv.num_free_blocks == kv.num_blocks - 1
    assert not llm.engine.proposer._sequences


def test_the_next_step_is_launched_before_a_verification_is_read(models, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="heron.engine.builder")
    llm = draft_llm(models)
    assert AHEAD in caplog.text and llm.engine.runner.async_verification
    runner, events = llm.engine.runner, []
    launch, result = runner.launch, LaunchedStep.result

    def launched(plan, *args):
        step = launch(plan, *args)
        events.append(("launch", step))
        return step

    def read(step):
        if not step._read:
            events.append(("read", step))
        return result(step)

    monkeypatch.setattr(runner, "launch", launched)
    monkeypatch.setattr(LaunchedStep, "result", read)
    outputs(llm, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    launches = [i for i, (kind, _) in enumerate(events) if kind == "launch"]
    ahead = 0
    for i, j in zip(launches, launches[1:]):
        step = events[i][1]
        if step.rollback is not None:  # the next target launch comes before its read
            read_at = next(k for k, (kind, s) in enumerate(events) if kind == "read" and s is step)
            assert read_at > j
            ahead += 1
    assert ahead >= 4


def test_greedy_equals_plain_with_stop_strings_and_max_tokens(models):
    """Requests end on ``max_tokens`` or a stop string, wherever it falls in an accepted
    block; the tokens after it are dropped and their blocks freed."""
    target, _ = models
    plain, llm = LLM(target), draft_llm(models)
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    text = outputs(plain, free)[0][1]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    for params in (
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
    ):
        want = outputs(plain, params)
        assert outputs(llm, params) == want
        assert_pools_empty(llm)
    assert want[0][2] == "stop"
    stats = llm.spec_decode_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_an_abort_while_a_verification_is_on_the_device(models):
    target, _ = models
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(target).generate(PROMPTS, params, use_tqdm=False)]
    llm = draft_llm(models)
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        llm.add_request(str(i), prompt, params)
    while engine.spec_decode_stats.num_drafts < 3 or engine._in_flight is None:
        llm.step()
    assert engine._in_flight.launched.rollback is not None
    assert llm.abort_request("1").outputs[0].finish_reason == "abort"
    done = {}
    while llm.has_unfinished_requests():
        for output in llm.step():
            if output.finished:
                done[output.request_id] = output.outputs[0].token_ids
    assert done == {"0": want[0], "2": want[2]}
    assert_pools_empty(llm)


def test_a_request_sampled_on_the_host_has_each_verification_read_first(models, monkeypatch):
    """A request with logprobs is sampled on the host (it verifies nothing): while it runs,
    its steps are read in the step that launches them, the others' proposals still verified
    beside it."""
    target, _ = models
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=logprobs)
        for logprobs in (None, 2, None)
    ]
    want = LLM(target).generate(PROMPTS, params, use_tqdm=False)
    llm = draft_llm(models)
    runner, ready = llm.engine.runner, []
    launch = runner.launch

    def launched(plan, *args):
        step = launch(plan, *args)
        ready.append(step.is_ready)
        return step

    monkeypatch.setattr(runner, "launch", launched)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert len(got[1].outputs[0].logprobs) == 12 and all(ready)
    assert llm.spec_decode_stats.num_drafts > 0
    assert_pools_empty(llm)


def test_seeded_sampling_equals_the_synchronous_verification(models, monkeypatch):
    """A seeded request draws a fixed amount per verified position: with every row verifying
    ``K`` proposals (uniform steps, what verification graphs replay) both ways verify the same
    positions, so they draw the same. (Otherwise a row's proposals near ``max_tokens`` are
    bounded by its pending tokens counted as accepted: fewer positions, other draws.)"""
    params = SamplingParams(temperature=0.8, top_k=5, max_tokens=20, seed=11, ignore_eos=True)
    runs = []
    for async_scheduling in (False, True):
        llm = draft_llm(models, async_scheduling=async_scheduling)
        monkeypatch.setattr(llm.engine.speculator, "uniform_up_to", 8)
        runs.append(outputs(llm, params))
        stats = llm.spec_decode_stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert runs[0] == runs[1]


def test_with_triton_attention_greedy_equals_plain(models, monkeypatch):
    """The operator that runs ahead on CUDA (its kernels in Triton's interpreter here): steps
    moved back on the device, the target's, and the draft's decode steps, each prepared on the
    device from the step before it (the first from the ingest, less the refusals)."""
    target, _ = models
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    prompts = PROMPTS[1:2]
    want = LLM(target, attention_backend="triton").generate(prompts, params, use_tqdm=False)
    llm = draft_llm(models, attention_backend="triton")
    assert llm.engine.runner.async_verification
    moved = []
    move_back = Verifier.move_back

    def counted(verifier, *args):
        moved.append(verifier)
        return move_back(verifier, *args)

    monkeypatch.setattr(Verifier, "move_back", counted)
    chained = []
    prepare = DecodeChainer.prepare

    def counted_chain(chainer, *args):
        step = prepare(chainer, *args)
        if step is not None:
            chained.append(chainer)
        return step

    monkeypatch.setattr(DecodeChainer, "prepare", counted_chain)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert llm.engine.runner.verifier in moved
    assert set(chained) == {llm.engine.draft_runner.decode_chain}
    assert_pools_empty(llm)


def test_host_lengths_and_ngram_keep_verification_synchronous(models, tmp_path, caplog):
    """A sliding window's tables start where the host's context says; n-gram proposals need
    the accepted tokens on the host: each verification is read before the next pass."""
    caplog.set_level(logging.INFO, logger="heron.engine.builder")
    windowed = save_tiny_model("mistral", tmp_path / "mistral")
    draft = save_truncated_draft(windowed, tmp_path / "draft")
    # (async_verification is on by default: refused here for the window)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": K}
    assert not LLM(str(windowed), speculative_config=spec).engine.runner.async_verification
    assert "the target's cache sliding window" in caplog.text
    ngram = {"method": "ngram", "num_speculative_tokens": K}
    assert not LLM(models[0], speculative_config=ngram).engine.runner.async_verification
    assert "n-gram proposals need the accepted tokens on the host" in caplog.text
    assert AHEAD not in caplog.text


@pytest.mark.gpu
def test_on_cuda_with_graphs_asynchronous_verification_equals_synchronous(models, monkeypatch):
    """bf16, the draft's decode graphs and the target's verification graphs, run past each
    verification or reading it first: the same tokens but where a step's batch differs (a
    request that finished in the verification run past still has its row, in another graph
    bucket), where each side's token is in HF's top-5; the draft's ingest steps replay its
    graphs of ``1 + K`` tokens."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    replays = graph_replays(monkeypatch)
    sync = outputs(draft_llm(models, async_scheduling=False, **CUDA_OPTIONS), params)
    replays.clear()
    llm = draft_llm(models, **CUDA_OPTIONS)
    assert llm.engine.runner.async_verification
    got = outputs(llm, params)
    print(f"{sum(a == b for a, b in zip(got, sync))}/{len(sync)} outputs identical")
    hf = tf.AutoModelForCausalLM.from_pretrained(models[0], dtype=torch.bfloat16).cuda().eval()
    for prompt, (a, *_), (b, *_) in zip(PROMPTS, got, sync):
        assert first_divergence_is_a_near_tie(hf, prompt, a, b)
    engine = llm.engine
    draft, target = engine.draft_runner.graphs, engine.runner.graphs
    assert {(id(draft), 1), (id(draft), 1 + K), (id(target), 1 + K)} <= set(replays)
    assert_pools_empty(llm)


def test_asynchronous_verification_is_asked_for(models):
    """Off unless ``speculative_config`` asks: each verification is then read first, and the
    reason names the field."""
    llm = draft_llm(models, async_verification=False)
    assert not llm.engine.runner.async_verification
    assert "async_verification" in llm.engine.sync_verification_reason
