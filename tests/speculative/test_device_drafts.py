"""A model proposer's proposals stay on the device into the target's verification step: no
host read between the draft's pass and the target's launch, and the same tokens (greedy and
seeded sampling) and counts as when the proposals are read on the host first; uniform steps
keep their query length to a request's end, and a row the draft cannot hold is sampled
beside the verified ones."""

from __future__ import annotations

import logging

import pytest

from heron import LLM, SamplingParams
from heron.execution.cuda_graph import CudaGraphRunner
from heron.execution.launched import LaunchedStep

from tiny_models import save_truncated_draft

PROMPTS = [[5, 6, 7, 8, 9] * 4, [3, 4, 3, 4, 3, 4, 3], list(range(10, 40))]


@pytest.fixture(scope="module")
def models(tiny_model_dir, tmp_path_factory):
    target = tiny_model_dir("llama")
    return str(target), str(save_truncated_draft(target, tmp_path_factory.mktemp("draft")))


def draft_llm(models, async_verification=True, **options) -> LLM:
    target, draft = models
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
    return LLM(
        target, speculative_config=spec | {"async_verification": async_verification}, **options
    )


def test_the_target_launches_before_the_drafts_are_read(models, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="heron.engine.builder")
    llm = draft_llm(models)
    assert "kept on the device up to the verification step" in caplog.text
    engine = llm.engine
    events: list[str] = []
    draft_steps: set[int] = set()
    draft_launch, target_launch, result = (
        engine.draft_runner.launch,
        engine.runner.launch,
        LaunchedStep.result,
    )

    def launched_draft(*args):
        step = draft_launch(*args)
        draft_steps.add(id(step))
        events.append("draft launch")
        return step

    def launched_target(plan, *args):
        events.append("verification" if plan.device_drafts else "target launch")
        return target_launch(plan, *args)

    def read(step):
        if id(step) in draft_steps and not step._read:
            events.append("draft read")
        return result(step)

    monkeypatch.setattr(engine.draft_runner, "launch", launched_draft)
    monkeypatch.setattr(engine.runner, "launch", launched_target)
    monkeypatch.setattr(LaunchedStep, "result", read)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm.generate(PROMPTS, params, use_tqdm=False)
    verifications = [i for i, event in enumerate(events) if event == "verification"]
    assert len(verifications) >= 4
    for v in verifications:
        # the pass before it: the last pass's steps read, then this one's launched, unread
        start = v
        while start and events[start - 1].startswith("draft"):
            start -= 1
        launches = events.index("draft launch", start)
        assert launches < v and "draft read" not in events[launches:v]


# bf16 with the draft's decode graphs and the target's verification graphs
CUDA_OPTIONS = dict(device="cuda", dtype="bfloat16", max_model_len=128, cuda_graph_max_bs=8)


def graph_replays(monkeypatch) -> list[tuple[int, int]]:
    """The ``id`` of the graphs and the query length of every graph replay from now on (ids,
    not the graphs: those would keep a finished engine's GPU memory from the next one)."""
    replays = []
    run = CudaGraphRunner.run

    def counted(graphs, seq):
        replays.append((id(graphs), seq.max_query_len))
        return run(graphs, seq)

    monkeypatch.setattr(CudaGraphRunner, "run", counted)
    return replays


def runs_both_ways(models, params, monkeypatch, **options) -> list[tuple]:
    """(outputs, proposals, accepted) with the proposals kept on the device, then read on the
    host before each verification; each verification is read before the next pass (the host's
    proposals are verified so: tests/speculative/test_async_verification.py compares the
    passes run past a verification)."""
    runs = []
    for on_device in (True, False):
        llm = draft_llm(models, seed=5, async_scheduling=False, **options)
        monkeypatch.setattr(llm.engine.speculator, "drafts_on_device", on_device)
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        stats = llm.spec_decode_stats
        runs.append(
            (
                [o.outputs[0].token_ids for o in outputs],
                stats.num_draft_tokens,
                stats.num_accepted_tokens,
            )
        )
        del llm  # on CUDA, the next engine's memory profile must not see this one
    return runs


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=5, max_tokens=20, seed=11, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
def test_proposals_on_the_device_verify_as_on_the_host(models, params, monkeypatch):
    runs = runs_both_ways(models, params, monkeypatch)
    assert runs[0] == runs[1]
    assert 0 < runs[0][2] < runs[0][1]  # some proposals accepted, some refused


@pytest.mark.gpu
def test_with_graphs_on_cuda_proposals_on_the_device_verify_as_on_the_host(models, monkeypatch):
    """bf16, the draft's decode graphs and the target's verification graphs: the proposals
    gathered from the draft's graph outputs are the ones read on the host (the same tokens;
    the counts may differ where the host pads a row's last proposals past ``max_tokens`` and
    the draft proposes them instead)."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    replays = graph_replays(monkeypatch)
    (device, *_), (host, *_) = runs_both_ways(models, params, monkeypatch, **CUDA_OPTIONS)
    assert device == host
    # draft decode and verification (1 + k) graphs
    assert {q for _, q in replays} >= {1, 4}


def test_uniform_steps_get_k_proposals_to_a_requests_end(models, monkeypatch):
    """With uniform steps (what verification graphs replay) the draft proposes ``k`` for
    every decode row, past ``max_tokens`` too, so a request's last steps keep the query
    length; the tokens past ``max_tokens`` are dropped, and both pools get every block back."""
    target, _ = models
    plain = LLM(target)
    llm = draft_llm(models)
    engine = llm.engine
    runner = engine.runner
    monkeypatch.setattr(engine.speculator, "uniform_up_to", 8)
    query_lens = set()
    launch = runner.launch

    def recorded(plan, *args):
        rows = zip(plan.request_ids, plan.num_new)
        query_lens.update(n for request_id, n in rows if request_id in plan.device_drafts)
        return launch(plan, *args)

    monkeypatch.setattr(runner, "launch", recorded)
    for max_tokens in (2, 5, 9):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        assert got == want
    assert query_lens == {1 + 3}
    for kv in (engine.kv_cache, engine.proposer.kv_cache):
        assert kv.num_free_blocks == kv.num_blocks - 1


def test_a_row_the_draft_pool_cannot_hold_is_sampled_beside_verified_rows(models, monkeypatch):
    """A pass whose draft allocation fails for one request gives it no proposals: its row is
    sampled plainly in the step that verifies the others' proposals on the device."""
    target, _ = models
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = LLM(target).generate(PROMPTS, params, use_tqdm=False)
    llm = draft_llm(models)
    kv = llm.engine.proposer.kv_cache
    allocate, refused = kv.allocate_slots, []

    def allocate_slots(seq, *args):
        if seq.request_id == "1" and len(refused) < 3:
            refused.append(seq.request_id)
            return False
        return allocate(seq, *args)

    monkeypatch.setattr(kv, "allocate_slots", allocate_slots)
    mixed = []
    launch = llm.engine.runner.launch

    def recorded(plan, *args):
        if plan.device_drafts:
            mixed.append("1" in plan.request_ids and "1" not in plan.device_drafts)
        return launch(plan, *args)

    monkeypatch.setattr(llm.engine.runner, "launch", recorded)
    for i, prompt in enumerate(PROMPTS):
        llm.add_request(str(i), prompt, params)
    done = {}
    while llm.has_unfinished_requests():
        for output in llm.step():
            if output.finished:
                done[output.request_id] = output.outputs[0].token_ids
    assert [done[str(i)] for i in range(len(PROMPTS))] == [o.outputs[0].token_ids for o in plain]
    assert len(refused) == 3 and sum(mixed) == 3
