"""Greedy decoding with a draft model's proposals equals greedy decoding without them, token
for token (fp32, CPU; where the two part, HF's logits of the two tokens must tie to 1e-5), with
chunked prefill, prefix hits and preemption under a tight pool; the draft's own cache is
checked after every step (no block held for a request that is gone, none past what the draft
computed) and gives every block back. A draft identical to the target has every proposal
accepted: the acceptance counts then say the catch-up and rollback bookkeeping is exact."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from test_speculative_parity import (
    OPTIONS,
    PROMPTS,
    assert_equal_up_to_exact_ties,
    check_runner_tables,
    generate_checked,
)

from heron import LLM, SamplingParams
from heron.speculative.draft_model import split_kv_budget

from tiny_models import first_divergence_is_a_near_tie, save_tiny_model, save_truncated_draft

K = 3
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def draft_config(path) -> dict:
    return {
        "method": "draft_model",
        "model": str(path),
        "num_speculative_tokens": K,
        "async_verification": True,
    }


def check_draft_cache(llm: LLM, monkeypatch) -> None:
    """After every step: the draft's pool is consistent, only running requests hold blocks in
    it, none past the tokens the draft computed, and those are the request's tokens up to the
    last pass's catch-up."""
    engine = llm.engine
    proposer, step = engine.proposer, engine.step

    def checked():
        outputs = step()
        kv = proposer.kv_cache
        kv.check_invariants()
        running = {r.request_id: r for r in engine.scheduler.running}
        held = set(kv.groups[0].request_ids())
        assert held <= set(running) and held == set(proposer._sequences)
        drafted = proposer.runner.requests
        for request_id in held:
            seq, request = proposer._sequences[request_id], running[request_id]
            for g in range(kv.num_groups):
                assert len(kv.block_table(request_id, g)) <= -(
                    -seq.num_computed_tokens // kv.block_size
                )
            n = seq.num_synced
            assert drafted[request_id].all_token_ids[:n] == request.all_token_ids[:n]
        return outputs

    monkeypatch.setattr(engine, "step", checked)


def assert_draft_pool_empty(llm: LLM) -> None:
    proposer = llm.engine.proposer
    assert proposer.kv_cache.num_free_blocks == proposer.kv_cache.num_blocks - 1
    assert not proposer._sequences


@pytest.mark.parametrize(
    ("family", "async_scheduling"),
    [("llama", True), ("qwen3", True), ("llama", False)],
    ids=["llama", "qwen3", "llama-each-verification-read-first"],
)
def test_greedy_with_a_draft_model_equals_greedy_without(
    family, async_scheduling, tmp_path, monkeypatch
):
    """With asynchronous verification (the default here: every step scheduled past the
    verification before it), and with each verification read before the next pass."""
    path = str(save_tiny_model(family, tmp_path / "target"))
    draft = save_truncated_draft(path, tmp_path / "draft")
    options = dict(OPTIONS, num_kv_blocks=40)
    plain = LLM(path, **options)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY, use_tqdm=False)]
    llm = LLM(
        path, **options, speculative_config=draft_config(draft), async_scheduling=async_scheduling
    )
    assert llm.engine.runner.async_verification == async_scheduling
    check_runner_tables(llm, monkeypatch)
    check_draft_cache(llm, monkeypatch)
    assert_equal_up_to_exact_ties(path, generate_checked(llm, PROMPTS, GREEDY), want)
    assert_draft_pool_empty(llm)
    # again, from the prefix caches (the target's and the draft's)
    assert_equal_up_to_exact_ties(path, generate_checked(llm, PROMPTS, GREEDY), want)
    assert_draft_pool_empty(llm)
    engine, stats = llm.engine, llm.engine.spec_decode_stats
    assert engine.kv_cache.prefix_cache_hits > 0
    assert engine.proposer.kv_cache.prefix_cache_hits > 0
    assert engine.scheduler.num_preemptions > 0
    # proposals were made, some accepted and some refused (rolled back)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_a_draft_equal_to_the_target_has_every_proposal_accepted(tiny_model_dir):
    """Each verifying step then gives ``K + 1`` tokens but where ``max_tokens`` cuts its
    proposals short: the ``r = m - 1`` tokens of a request of ``m`` after the prefill's come in
    ``ceil(r / (K + 1))`` steps that propose all but one of their tokens (a last step of one
    token proposes nothing, so verifies nothing)."""
    path = str(tiny_model_dir("llama"))
    max_tokens = [24, 9, 5, 2, 13]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    plain = LLM(path).generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(path, speculative_config=draft_config(path))
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    stats = llm.spec_decode_stats
    rest = [m - 1 for m in max_tokens]
    steps = [-(-r // (K + 1)) for r in rest]
    assert stats.num_drafts == sum(n - (r % (K + 1) == 1) for r, n in zip(rest, steps))
    assert stats.num_accepted_tokens == stats.num_draft_tokens == sum(rest) - sum(steps)
    assert stats.mean_acceptance_length > K  # (K + 1 but for the cut steps)
    assert_draft_pool_empty(llm)


def test_aborted_requests_give_the_draft_blocks_back(tiny_model_dir, tmp_path):
    path = tiny_model_dir("llama")
    draft = save_truncated_draft(path, tmp_path / "draft")
    llm = LLM(str(path), speculative_config=draft_config(draft))
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        llm.add_request(str(i), prompt, GREEDY)
    while engine.spec_decode_stats.num_drafts < 4:
        llm.step()
    assert engine.proposer._sequences  # the draft holds blocks for them
    for i in range(len(PROMPTS)):
        llm.abort_request(str(i))
    assert_draft_pool_empty(llm)
    llm.step()  # the draft's runner forgets them with its next plan
    assert not llm.has_unfinished_requests()


def test_the_kv_budget_splits_to_as_many_sequences_each(tiny_model_dir, tmp_path):
    """The draft's share of the budget holds as many max-length sequences as the target's."""
    path = tiny_model_dir("llama")
    draft = save_truncated_draft(path, tmp_path / "draft")
    engine = LLM(str(path), max_model_len=128, speculative_config=draft_config(draft)).engine
    layouts = (engine.runner.cache, engine.draft_runner.cache)
    budget = 10 << 20
    shares = split_kv_budget(budget, *layouts, 128, engine.max_num_batched_tokens)
    assert sum(shares) == budget
    (target,), (drafted,) = (
        layout.split_budget(share, 128, engine.max_num_batched_tokens)
        for layout, share in zip(layouts, shares)
    )
    assert abs(target - drafted) <= 1  # one block size, one group: blocks per sequence agree
    assert drafted * layouts[1].bytes_per_block()[0] < target * layouts[0].bytes_per_block()[0]


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_bf16_with_graphs_on_cuda_is_plain_greedy_up_to_near_ties(family, tmp_path):
    """bf16 with the target's verification graphs and the draft's decode graphs: where the
    tokens first part from plain greedy's, each side's token is in HF's top-5."""
    path = str(save_tiny_model(family, tmp_path / "target"))
    draft = save_truncated_draft(path, tmp_path / "draft")
    options = dict(device="cuda", dtype="bfloat16", max_model_len=128, num_kv_blocks=64)
    plain = LLM(path, cuda_graph_max_bs=8, **options)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY, use_tqdm=False)]
    llm = LLM(path, cuda_graph_max_bs=8, speculative_config=draft_config(draft), **options)
    assert llm.engine.draft_runner.graphs is not None
    replayed = []
    run = llm.engine.draft_runner.graphs.run
    llm.engine.draft_runner.graphs.run = lambda seq: replayed.append(seq.num_reqs) or run(seq)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert replayed  # the draft's decode steps replayed its graphs
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    identical = sum(a == b for a, b in zip(got, want))
    print(f"{identical}/{len(want)} outputs identical to plain greedy")
    for prompt, a, b in zip(PROMPTS, got, want):
        assert first_divergence_is_a_near_tie(hf, prompt, a, b)
    assert 0 < llm.spec_decode_stats.num_accepted_tokens
    assert_draft_pool_empty(llm)
