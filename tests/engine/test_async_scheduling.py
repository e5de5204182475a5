"""Asynchronous scheduling: the next step is launched before the previous step's tokens are read.

The reference is the same engine with ``async_scheduling=False`` (every step read before the
next is scheduled), itself tested token for token against HF transformers.
"""

from __future__ import annotations

import pytest

from heron import LLM, SamplingParams


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    path = str(tiny_model_dir("llama"))
    # A small pool, so that the staggered workload below preempts.
    options = dict(max_model_len=96, num_kv_blocks=24, block_size=8, max_num_batched_tokens=48)
    return {mode: LLM(path, async_scheduling=mode, **options) for mode in (True, False)}


def _staggered(llm, abort_at: dict[int, str]) -> tuple[dict[str, tuple], int]:
    """Requests join, stop (EOS off: stop tokens, max_tokens, max_model_len) and are aborted
    between steps; returns every request's final tokens and reason, and the step count."""
    arrivals = {0: 3, 2: 2, 5: 3, 9: 2}
    finished: dict[str, tuple] = {}
    step, added = 0, 0
    while step < 12 or llm.has_unfinished_requests():
        for _ in range(arrivals.get(step, 0)):
            i = added
            prompt = [(i * 17 + j) % 250 + 3 for j in range(4 + 7 * i)]
            params = SamplingParams(
                temperature=0,
                ignore_eos=True,
                max_tokens=None if i == 4 else 6 + 5 * i,  # request 4 runs into max_model_len
                stop_token_ids=list(range(i % 5, 300, 7)) if i % 3 == 0 else [],
            )
            llm.add_request(f"r{i}", prompt, params)
            added += 1
        if step in abort_at:
            out = llm.abort_request(abort_at[step])
            finished[out.request_id] = (tuple(out.outputs[0].token_ids), "abort")
        for out in llm.step():
            o = out.outputs[0]
            assert len(o.token_ids) == len(set(range(len(o.token_ids))))  # well-formed snapshot
            if out.finished:
                finished[out.request_id] = (tuple(o.token_ids), o.finish_reason)
        step += 1
        assert step < 500
    return finished, step


def _assert_idle(llm) -> None:
    engine = llm.engine
    engine.kv_cache.check_invariants()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks - 1
    for request in engine.scheduler.running + list(engine.scheduler.waiting):
        raise AssertionError(f"{request.request_id} left behind")


def test_async_equals_sync_with_stops_preemption_and_aborts(engines):
    aborts = {6: "r1", 11: "r5"}
    async_result, _ = _staggered(engines[True], aborts)
    sync_result, _ = _staggered(engines[False], aborts)
    for request_id in aborts.values():
        # An abort drops the token still in flight: async has read one step less by then.
        tokens, _ = async_result.pop(request_id)
        reference, _ = sync_result.pop(request_id)
        assert tokens == reference[: len(tokens)] and len(reference) - len(tokens) <= 1
    assert async_result == sync_result
    reasons = {reason for _, reason in async_result.values()}
    assert {"length", "stop"} <= reasons
    assert len(async_result["r4"][0]) == 96 - len(range(4 + 7 * 4))  # filled max_model_len
    assert engines[True].engine.scheduler.num_preemptions > 0
    for engine in engines.values():
        _assert_idle(engine)


def test_tokens_stay_on_device_between_steps(engines):
    """A plain greedy decode step is left in flight; its tokens become the next step's inputs
    on the device, and a request is never scheduled past its last token."""
    llm = engines[True]
    llm.add_request("d", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=4))
    launched = []
    runner = llm.engine.runner
    launch = runner.launch

    def spy(plan, previous=None, drafts=None):
        if plan.request_ids:
            launched.append(list(zip(plan.request_ids, plan.num_new)))
        return launch(plan, previous, drafts)

    runner.launch = spy
    try:
        outputs = []
        while llm.has_unfinished_requests():
            outputs += llm.step()
    finally:
        del runner.launch
    # Prefill, then three decode steps whose input token was still pending; the fourth token
    # ends the request, so no fifth step is launched for it.
    assert launched == [[("d", 4)], [("d", 1)], [("d", 1)], [("d", 1)]]
    assert len(outputs[-1].outputs[0].token_ids) == 4 and outputs[-1].finished
    _assert_idle(llm)


def test_seeded_random_sampling_stays_on_device_and_equals_sync(engines):
    """Temperature / top-p sampling is drawn on the device and read one step later, with the
    same tokens as the synchronous engine (each request draws from its own seeded generator)."""
    results = []
    for mode in (True, False):
        llm = engines[mode]
        for i in range(3):
            params = SamplingParams(
                temperature=0.8, top_p=0.9, seed=11 + i, max_tokens=12, ignore_eos=True
            )
            llm.add_request(f"t{i}", [9 + i, 10, 11, 12], params)
        llm.add_request("g", [9, 10], SamplingParams(temperature=0, max_tokens=12))
        first = llm.step()
        assert not first or mode is False  # async: the prefill's tokens are read next call
        outputs = {o.request_id: o.outputs[0].token_ids for o in first if o.finished}
        while llm.has_unfinished_requests():
            outputs.update({o.request_id: o.outputs[0].token_ids for o in llm.step() if o.finished})
        results.append(outputs)
        _assert_idle(llm)
    assert results[0] == results[1] and len(results[0]) == 4


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, seed=3, max_tokens=3, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=3, min_tokens=2),
    ],
    ids=["logprobs", "penalty", "min_tokens"],
)
def test_steps_that_need_the_host_are_read_at_once(engines, params):
    llm = engines[True]
    llm.add_request("s", [9, 10, 11], params)
    outputs = llm.step()
    assert outputs and len(outputs[0].outputs[0].token_ids) == 1  # read in the same call
    while llm.has_unfinished_requests():
        llm.step()
    _assert_idle(llm)
